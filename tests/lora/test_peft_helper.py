"""A bad adapter is refused with a ValueError naming the problem, when the request is added,
and the engine goes on serving (vLLM checks the same things when it loads an adapter)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.entrypoints.llm import LLM
from minivllm.lora.peft_helper import load_peft_helper
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams


def copy_adapter(src: str, dst: Path, config_changes: dict | None = None, tensors=None) -> str:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return str(dst)


def _grow_rank(tensors):
    """Every A gets an extra row and every B an extra column: a rank-9 adapter under r=8."""
    return {k: torch.cat([v, v[:1]]) if "lora_A" in k else torch.cat([v, v[:, :1]], 1) for k, v in tensors.items()}


def _wrong_width(tensors):
    return {k: (v[:, :-1] if "lora_A" in k else v).contiguous() for k, v in tensors.items()}


BAD = {
    "no-folder": (None, "no such folder"),
    "rank": ({"r": 8}, "above max_lora_rank=4"),
    "unknown-target": ({"target_modules": ["q_proj", "lm_head"]}, r"unsupported modules \['lm_head'\]"),
    "dora": ({"use_dora": True}, "DoRA"),
    "bias": ({"bias": "all"}, "bias='none'"),
    "shape": ("shape", r"has shape \[8, (63|127)\], expected \[8, (64|128)\] for this base model"),
    "missing-weights": ("no-weights", "has no adapter_model.safetensors"),
    "missing-config": ("no-config", "has no adapter_config.json"),
    "not-in-targets": ({"target_modules": ["q_proj"]}, "not in target_modules"),
}


def make_bad(kind: str, src: str, root: Path) -> str:
    change, _ = BAD[kind]
    dst = root / kind
    if change is None:
        return str(dst)
    if change == "shape":
        return copy_adapter(src, dst, tensors=_wrong_width)
    if change == "no-weights":
        copy_adapter(src, dst)
        (dst / "adapter_model.safetensors").rename(dst / "adapter_model.bin")
        return str(dst)
    if change == "no-config":
        copy_adapter(src, dst)
        (dst / "adapter_config.json").unlink()
        return str(dst)
    return copy_adapter(src, dst, change)


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_adapter_is_a_value_error_naming_the_problem(lora_base, adapters, tmp_path, kind):
    _, base = lora_base
    path = make_bad(kind, adapters["all"].path, tmp_path)
    max_rank = 4 if kind == "rank" else 8
    with pytest.raises(ValueError, match=BAD[kind][1]):
        load_peft_helper(path, base.config, max_rank)


def test_rank_above_the_slot_width_found_in_the_tensors(lora_base, adapters, tmp_path):
    path = copy_adapter(adapters["all"].path, tmp_path / "grown", tensors=_grow_rank)
    with pytest.raises(ValueError, match=r"has shape \[9, \d+\], expected \[8, \d+\] for this base model \(r=8\)"):
        load_peft_helper(path, lora_base[1].config, 16)


def test_the_engine_refuses_a_bad_adapter_and_keeps_serving(lora_base, adapters, tmp_path):
    path, _ = lora_base
    llm = LLM(path, enable_lora=True, max_lora_rank=8, device="cpu", dtype="float32", block_size=8)
    bad = LoRARequest("bad", 1, make_bad("unknown-target", adapters["all"].path, tmp_path))
    good = LoRARequest("good", 2, adapters["all"].path)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="lm_head"):
        llm.generate(["ab", "cd"], params, lora_request=[good, bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the good one of the call was taken back
    assert len(llm.generate(["ab"], params, lora_request=good, use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="already names adapter 'good'"):
        llm.generate("ab", params, lora_request=LoRARequest("other", 2, adapters["some"].path), use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["ab", "cd"], params, lora_request=[good], use_tqdm=False)


def test_lora_request_without_enable_lora(lora_base, adapters):
    llm = LLM(lora_base[0], device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("ab", lora_request=LoRARequest("a", 1, adapters["all"].path), use_tqdm=False)


@pytest.mark.parametrize("args,match", [
    (dict(enable_lora=True, max_loras=0), "max_loras must be"),
    (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), "max_cpu_loras"),
    (dict(max_loras=2), "need enable_lora"),
    (dict(enable_lora=True, speculative_model="[ngram]", num_speculative_tokens=2, ngram_prompt_lookup_max=2),
     "enable_lora cannot be combined"),
])
def test_lora_engine_arguments_are_checked(args, match):
    from minivllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(device="cpu", **args).create_engine_config()


@pytest.mark.parametrize("fields,match", [(("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "at least 1"),
                                          (("a", True, "/x"), "at least 1"), (("a", 1, ""), "lora_path")])
def test_lora_request_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(*fields)


@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]", b"\xff" * 16],
                         ids=["empty", "header-not-an-object", "garbage"])
def test_a_damaged_weights_file(lora_base, adapters, tmp_path, content):
    path = copy_adapter(adapters["all"].path, tmp_path / "damaged")
    (Path(path) / "adapter_model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_peft_helper(path, lora_base[1].config, 8)


def _no_config_readable(root: Path, adapter: str) -> dict[str, str]:
    """Paths that hold no adapter config, each for another reason."""
    (root / "a-file").write_text("x")
    (root / "empty").mkdir()
    (root / "config-is-a-folder" / "adapter_config.json").mkdir(parents=True)
    not_json = Path(copy_adapter(adapter, root / "not-json"))
    (not_json / "adapter_config.json").write_bytes(b"\xff{")
    return {"missing": str(root / "nothing-here"), "a file": str(root / "a-file"), "no config": str(root / "empty"),
            "unreadable config": str(root / "config-is-a-folder"), "not json": str(not_json),
            "nul byte": str(root / "x\x00y")}


def test_every_path_without_a_readable_config_gets_the_same_message(lora_base, adapters, tmp_path):
    """No existence oracle: a client loading adapters cannot tell a missing folder from one
    without adapter_config.json or an unreadable one."""
    messages = {}
    for reason, path in _no_config_readable(tmp_path, adapters["all"].path).items():
        with pytest.raises(ValueError) as error:
            load_peft_helper(path, lora_base[1].config, 8)
        messages[reason] = str(error.value).replace(repr(path), "<path>")
    assert len(set(messages.values())) == 1, messages
    with pytest.raises(ValueError, match="at most 1024 characters"):
        load_peft_helper("/" + "a" * 5000, lora_base[1].config, 8)


def _with_value(value: float, dtype=torch.float32):
    def change(tensors):
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].to(dtype)
        tensors[name].view(-1)[3] = value
        return tensors
    return change


def _retyped(tensors):
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    return tensors


BAD_WEIGHTS = {
    "nan": (_with_value(float("nan")), "NaN or infinite"),
    "inf-bf16": (_with_value(float("inf"), torch.bfloat16), "NaN or infinite"),
    "-inf-fp16": (_with_value(float("-inf"), torch.float16), "NaN or infinite"),
    "integers": (_retyped, "dtype 'I32'; LoRA weights must be floating point"),
}


@pytest.mark.parametrize("kind", list(BAD_WEIGHTS))
def test_bad_weight_values_are_refused_at_load(lora_base, adapters, tmp_path, kind):
    change, match = BAD_WEIGHTS[kind]
    path = copy_adapter(adapters["all"].path, tmp_path / kind, tensors=change)
    with pytest.raises(ValueError, match=match):
        load_peft_helper(path, lora_base[1].config, 8)


def test_a_truncated_weights_file_is_refused_at_load(lora_base, adapters, tmp_path):
    path = copy_adapter(adapters["all"].path, tmp_path / "truncated")
    weights = Path(path) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match="truncated"):
        load_peft_helper(path, lora_base[1].config, 8)


@pytest.mark.parametrize("change,match", [({"lora_alpha": 0}, "lora_alpha must be a number in"),
                                          ({"lora_alpha": -16}, "lora_alpha must be a number in"),
                                          ({"lora_alpha": 1e9}, "lora_alpha must be a number in"),
                                          ({"lora_alpha": "16"}, "lora_alpha must be a number in"),
                                          ({"use_rslora": "yes"}, "use_rslora must be true or false"),
                                          ({"r": 8.0}, "r must be a positive integer")])
def test_adapter_settings_out_of_range(lora_base, adapters, tmp_path, change, match):
    path = copy_adapter(adapters["all"].path, tmp_path / "settings", change)
    with pytest.raises(ValueError, match=match):
        load_peft_helper(path, lora_base[1].config, 8)


def test_the_shipped_adapters_pass_every_check(lora_base, adapters):
    for adapter in adapters.values():
        assert load_peft_helper(adapter.path, lora_base[1].config, 8).tensors
