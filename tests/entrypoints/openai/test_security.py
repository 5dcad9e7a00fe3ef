"""A server safe to share: the API key, the Host check, size limits, tokenization off the
event loop, and nothing private in any answer. Loopback only.

The key and limits are tested on a second server (small limits, an API key) over its own
engine, so that the shared `server` of this directory stays open for the other tests.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path

import httpx
import openai
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.api_server import ServerThread, app_options, build_app
from minivllm.entrypoints.openai.cli_args import add_serve_args
from minivllm.entrypoints.openai.serving_engine import OpenAIServing

MODEL = "tiny-shakespeare"
KEY = "sekret-key"
MAX_BODY_BYTES = 64 * 1024
MAX_PROMPTS = 4


@pytest.fixture(scope="module")
def keyed_server():
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(device="cpu", seed=0, max_model_len=128, max_num_seqs=4,
                                                        num_gpu_blocks_override=32, swap_space=0.01))
    app = build_app(engine, MODEL, api_key=KEY, max_body_bytes=MAX_BODY_BYTES, max_prompts_per_request=MAX_PROMPTS)
    with ServerThread(app) as running:
        yield running
    engine.shutdown()


def authorized(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ------------------------------------------------------------------------ API key
@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"),
])
def test_every_route_but_health_needs_the_key(keyed_server, method, path):
    for headers in ({}, authorized("wrong"), {"Authorization": KEY}):  # none, wrong, not a Bearer
        response = httpx.request(method, keyed_server.url + path, headers=headers, json={})
        assert response.status_code == 401, (path, headers)
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.request(method, keyed_server.url + path, headers=authorized(), json={}).status_code != 401
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes carry no key


def test_the_openai_client_with_and_without_the_key(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    response = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, temperature=0.0)
    assert response.usage.completion_tokens == 3
    streamed = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == response.choices[0].text


def test_the_key_comes_from_the_flag_or_the_environment():
    parser = add_serve_args(argparse.ArgumentParser())
    assert app_options(parser.parse_args([]), {})["api_key"] is None
    assert app_options(parser.parse_args([]), {"MINIVLLM_API_KEY": "from-env"})["api_key"] == "from-env"
    assert app_options(parser.parse_args(["--api-key", "flag"]), {"MINIVLLM_API_KEY": "env"})["api_key"] == "flag"


# ------------------------------------------------------------------- Host, CORS
def test_a_foreign_host_header_is_refused_on_loopback(keyed_server):
    port = keyed_server.port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):  # what DNS rebinding sends
        assert httpx.get(keyed_server.url + "/health", headers={"Host": host}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert httpx.get(keyed_server.url + "/health", headers={"Host": host}).status_code == 200


def test_hosts_default_to_loopback_names_only_when_bound_to_loopback():
    parser = add_serve_args(argparse.ArgumentParser())
    assert "localhost" in app_options(parser.parse_args([]), {})["allowed_hosts"]
    assert app_options(parser.parse_args(["--host", "0.0.0.0", "--api-key", "k"]), {})["allowed_hosts"] is None
    assert app_options(parser.parse_args(["--allowed-hosts", "llm.lan"]), {})["allowed_hosts"] == ["llm.lan"]


def test_no_cors_headers_unless_origins_are_allowed(keyed_server):
    response = httpx.get(keyed_server.url + "/v1/models", headers={**authorized(), "Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_help_states_the_default_bind_address_and_cors():
    help_text = " ".join(add_serve_args(argparse.ArgumentParser()).format_help().split())
    assert "default: 127.0.0.1" in help_text and "CORS" in help_text and "MINIVLLM_API_KEY" in help_text


# ------------------------------------------------------------------------ limits
def test_a_body_over_the_limit_is_a_413_whether_declared_or_chunked(keyed_server):
    big = b'{"model": "tiny-shakespeare", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    url = keyed_server.url + "/v1/completions"
    declared = httpx.post(url, content=big, headers={**authorized(), "content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit must hold while reading
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    chunked = httpx.post(url, content=chunks(), headers={**authorized(), "content-type": "application/json"})
    assert chunked.status_code == 413


def test_prompts_per_request_are_capped(keyed_server):
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="at most 4 prompts"):
        client.completions.create(model=MODEL, prompt=["x"] * (MAX_PROMPTS + 1), max_tokens=1)
    assert len(client.completions.create(model=MODEL, prompt=["x"] * MAX_PROMPTS, max_tokens=1).choices) == MAX_PROMPTS


# ----------------------------------------------------------- nothing private
def test_models_show_the_served_name_not_the_checkpoint_path(server, client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.root == MODEL
    checkpoint = server.app.state.engine.model_config.model
    assert str(Path(checkpoint).parent) not in httpx.get(server.url + "/v1/models").text


def test_no_created_series_in_metrics(server):
    assert "_created" not in httpx.get(server.url + "/metrics").text


# --------------------------------------------------------- tokenization
def test_a_slow_tokenization_does_not_hold_up_other_requests(server, client, monkeypatch):
    """One prompt's tokenization is stuck (as a megabyte prompt would be, for seconds): other
    requests are tokenized on other threads and answered meanwhile."""
    release = threading.Event()
    real = OpenAIServing._call_thread_tokenizer

    def call(self, method, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("SLOW"):
            assert release.wait(timeout=30)
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(OpenAIServing, "_call_thread_tokenizer", call)

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as aclient:
            slow = asyncio.ensure_future(aclient.completions.create(model=MODEL, prompt="SLOW prompt", max_tokens=2))
            await asyncio.sleep(0.05)
            fast = await asyncio.wait_for(aclient.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2), 20)
            assert fast.usage.completion_tokens == 2 and not slow.done()
            release.set()
            assert (await slow).usage.completion_tokens == 2

    asyncio.run(run())
