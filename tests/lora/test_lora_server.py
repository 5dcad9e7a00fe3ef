"""The server with `--enable-lora --lora-modules name=path`: /v1/models lists the adapters, a
request's `model` picks one (greedy text equals the PEFT-merged model's), and the run-time
routes (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set, behind --api-key when one is set)
load and unload adapters with vLLM's 400 / 404 errors, telling nothing about the server's files."""

from __future__ import annotations

import json
import shutil

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import openai  # noqa: E402

import engine_test_checkpoints as checkpoints  # noqa: E402
from minivllm.engine.arg_utils import EngineArgs  # noqa: E402
from minivllm.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from minivllm.entrypoints.openai.cli_args import make_arg_parser  # noqa: E402
from minivllm.entrypoints.openai.serving_models import LoRAModulePath  # noqa: E402

MAX_TOKENS = 5


API_KEY = "test-key"


def lora_engine(lora_base) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(EngineArgs(
        model=lora_base[0], device="cpu", dtype="float32", block_size=8, enable_lora=True, max_loras=2,
        max_lora_rank=8, num_gpu_blocks_override=64, swap_space=0.01))


@pytest.fixture(scope="module")
def server(lora_base, adapters):
    engine = lora_engine(lora_base)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        app = build_app(engine, "base", lora_modules=[LoRAModulePath("all", adapters["all"].path)])
    with ServerThread(app) as running:
        yield running
    engine.shutdown()


def complete(server, model: str, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def decode(ids: list[int]) -> str:
    return checkpoints.build_tokenizer().decode(ids, skip_special_tokens=True)  # as the server does


def test_models_list_and_routing(server, lora_base, adapters):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("base", None), ("all", "base")]
    prompt = checkpoints.mixed_prompts(3, seed=7, max_len=12)[2]
    assert complete(server, "all", prompt) == decode(checkpoints.hf_greedy(adapters["all"].merged, prompt, MAX_TOKENS))
    assert complete(server, "base", prompt) == decode(checkpoints.hf_greedy(lora_base[1], prompt, MAX_TOKENS))


def test_load_use_and_unload_an_adapter(server, adapters, tmp_path):
    post = lambda route, body: httpx.post(server.url + route, json=body)  # noqa: E731
    assert post("/v1/load_lora_adapter", {"lora_name": "some", "lora_path": adapters["some"].path}).status_code == 200
    prompt = checkpoints.mixed_prompts(3, seed=8, max_len=12)[2]
    assert complete(server, "some", prompt) == decode(checkpoints.hf_greedy(adapters["some"].merged, prompt, MAX_TOKENS))
    again = post("/v1/load_lora_adapter", {"lora_name": "some", "lora_path": adapters["some"].path})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "some"}).status_code == 200
    gone = post("/v1/unload_lora_adapter", {"lora_name": "some"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        complete(server, "some", prompt)
    # Loaded again, it is the same adapter again (a fresh id: no stale weights).
    assert post("/v1/load_lora_adapter", {"lora_name": "some", "lora_path": adapters["some"].path}).status_code == 200
    assert complete(server, "some", prompt) == decode(checkpoints.hf_greedy(adapters["some"].merged, prompt, MAX_TOKENS))


@pytest.mark.parametrize("body,match", [
    ({"lora_name": "x"}, "must be provided"),
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, "no such folder"),
    ({"lora_name": "base", "lora_path": "/x"}, "already been loaded"),
])
def test_bad_load_requests_are_400(server, body, match):
    response = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
    assert response.status_code == 400 and match in response.json()["error"]["message"]
    assert "x" not in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]


def test_lora_modules_flag():
    args = make_arg_parser().parse_args(["--enable-lora", "--lora-modules", "a=/p/a", "b=/p/b", "--max-loras", "2"])
    assert args.lora_modules == [LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b")]
    assert args.enable_lora and args.max_loras == 2
    from minivllm.entrypoints.openai.api_server import app_options  # what `minivllm serve` hands build_app

    assert app_options(args, {})["lora_modules"] == args.lora_modules
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--lora-modules", "no-equals-sign"])


def test_lora_modules_need_enable_lora(lora_base, adapters):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=lora_base[0], device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        build_app(engine, "base", lora_modules=[LoRAModulePath("all", adapters["all"].path)])
    app = build_app(engine, "base")
    assert "/v1/load_lora_adapter" not in {route.path for route in app.routes}
    engine.shutdown()


def test_runtime_loading_needs_the_environment_variable(lora_base, monkeypatch):
    engine = lora_engine(lora_base)
    for value in (None, "0", "false", ""):
        if value is None:
            monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        else:
            monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        paths = {route.path for route in build_app(engine, "base").routes}
        assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths, value
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert "/v1/load_lora_adapter" in {route.path for route in build_app(engine, "base").routes}
    engine.shutdown()


def test_runtime_loading_needs_the_api_key(lora_base, adapters, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    engine = lora_engine(lora_base)
    body = {"lora_name": "some", "lora_path": adapters["some"].path}
    with ServerThread(build_app(engine, "base", api_key=API_KEY)) as running:
        assert httpx.post(running.url + "/v1/load_lora_adapter", json=body).status_code == 401
        assert httpx.post(running.url + "/v1/unload_lora_adapter", json={"lora_name": "some"}).status_code == 401
        keyed = httpx.post(running.url + "/v1/load_lora_adapter", json=body,
                           headers={"Authorization": f"Bearer {API_KEY}"})
        assert keyed.status_code == 200
    engine.shutdown()


def load(server, name, path) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def served_names(server) -> list[str]:
    response = httpx.get(server.url + "/v1/models")
    assert response.status_code == 200
    return [m["id"] for m in response.json()["data"]]


def test_no_existence_oracle(server, adapters, tmp_path):
    """A missing folder, a file, a folder without adapter_config.json and an unreadable config
    all get the same 400; an over-long path a 400 too, never a 500."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "unreadable" / "adapter_config.json").mkdir(parents=True)
    answers = {}
    for reason in ("missing", "empty", "a-file", "unreadable"):
        path = str(tmp_path / reason)
        response = load(server, "x", path)
        assert response.status_code == 400, response.text
        answers[reason] = response.json()["error"]["message"].replace(path, "<path>")
    assert len(set(answers.values())) == 1, answers
    long = load(server, "x", "/" + "a" * 5000)
    assert long.status_code == 400 and "at most" in long.json()["error"]["message"]
    assert "x" not in served_names(server)


@pytest.mark.parametrize("name", ["\udc80", "a\nb", "tab\there", " padded", "x" * 129])
def test_a_bad_adapter_name_is_refused_and_never_registered(server, adapters, name):
    response = httpx.post(server.url + "/v1/load_lora_adapter",
                          content=json.dumps({"lora_name": name, "lora_path": adapters["some"].path}),
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name", response.text
    names = served_names(server)  # /v1/models still answers
    assert name not in names and names[:2] == ["base", "all"]


def test_an_adapter_with_nan_weights_is_refused_at_load(server, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(adapters["some"].path, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    tensors[sorted(tensors)[0]][0, 0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors")
    response = load(server, "nan", str(bad))
    assert response.status_code == 400 and "NaN or infinite" in response.json()["error"]["message"]
    assert "nan" not in served_names(server)
