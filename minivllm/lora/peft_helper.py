"""Read and check a PEFT adapter folder, before any weight is loaded.

vLLM's `vllm/lora/peft_helper.py` and the checks of `LoRAModel.from_local_checkpoint`. A PEFT
LoRA adapter is a folder with

    adapter_config.json        {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", ...], ...}
    adapter_model.safetensors  per target module and layer, two matrices:
        base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]
        base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r]

and the adapted layer computes W x + scaling * B (A x), scaling = lora_alpha / r
(lora_alpha / sqrt(r) with `use_rslora`).

Everything here is checked against the base model's config without torch (the safetensors
header is JSON: names, dtypes, shapes and byte ranges; the values are read as raw bits to
find NaN and infinity), so the engine rejects a bad adapter with a ValueError naming the
problem when it is loaded, never inside a model step. A path that holds no readable adapter
config gets one message whatever the reason (missing, not a folder, unreadable), so an
adapter-loading client learns nothing about the server's files. What is not supported says
so: DoRA, trained biases, `modules_to_save`, the embedding and LM head.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (Hugging Face's names in a Llama-family layer).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                          r"(\w+)\.lora_(A|B)\.weight$")
_HEADER_LENGTH_BYTES = 8
# Longer paths are refused before the file system sees them (Linux's PATH_MAX is 4096).
MAX_LORA_PATH_CHARS = 1024
# lora_alpha is a scale: past this, B (A x) swamps the base model's output.
MAX_LORA_ALPHA = 4096.0
# Floating-point safetensors dtypes -> (bytes per value, exponent-bit mask of the raw value):
# a value is NaN or infinite exactly when all its exponent bits are set.
_FLOAT_DTYPES = {"F64": (8, 0x7FF0000000000000), "F32": (4, 0x7F800000), "F16": (2, 0x7C00),
                 "BF16": (2, 0x7F80)}
_UINT_OF_SIZE = {8: np.uint64, 4: np.uint32, 2: np.uint16}


@dataclass
class PEFTHelper:
    """An adapter's settings and the shapes of its matrices, all checked.

    `tensors`: safetensors name -> (layer index, module name, "A" or "B", shape).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    tensors: dict[str, tuple[int, str, str, tuple[int, ...]]]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Module name -> (out_features, in_features) of the base model's (unsplit) weight."""
    hidden = hf_config.hidden_size
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    inter = hf_config.intermediate_size
    return {"q_proj": (num_heads * head_dim, hidden), "k_proj": (num_kv_heads * head_dim, hidden),
            "v_proj": (num_kv_heads * head_dim, hidden), "o_proj": (hidden, num_heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def adapter_num_params(hf_config: Any, r: int, target_modules=SUPPORTED_MODULES) -> int:
    """Parameters of a rank-r adapter on `target_modules` of every layer: r (in + out) each.

    For a projection of `[out, in]` that is r * (in + out) against in * out for the weight:
    a rank-16 adapter on a 1024 x 1024 matrix is 1/32 of it."""
    shapes = module_shapes(hf_config)
    return hf_config.num_hidden_layers * sum(r * sum(shapes[m]) for m in target_modules)


def load_peft_helper(lora_path: str, hf_config: Any, max_lora_rank: int) -> PEFTHelper:
    """Check the adapter at `lora_path` against the base model; ValueError naming the problem."""
    config = _read_config(lora_path)
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA adapter {lora_path!r}: r must be a positive integer, got {r!r}.")
    if r > max_lora_rank:
        raise ValueError(f"LoRA adapter {lora_path!r} has rank {r}, above max_lora_rank={max_lora_rank}: "
                         "raise --max-lora-rank.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= MAX_LORA_ALPHA:
        raise ValueError(f"LoRA adapter {lora_path!r}: lora_alpha must be a number in (0, {MAX_LORA_ALPHA:g}], "
                         f"got {alpha!r}.")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise ValueError(f"LoRA adapter {lora_path!r}: use_rslora must be true or false, got {use_rslora!r}.")
    _check_unsupported(config, lora_path)
    targets = _target_modules(config, lora_path)
    folder = Path(lora_path).expanduser()
    header, data_start = _read_header(folder, lora_path)
    tensors = _read_shapes(header, lora_path)
    _check_shapes(tensors, r, module_shapes(hf_config), hf_config.num_hidden_layers, targets, lora_path)
    _check_values(folder / WEIGHTS_FILE, header, data_start, lora_path)
    return PEFTHelper(r, float(alpha), use_rslora, targets, tensors)


def _read_config(lora_path: str) -> dict:
    """adapter_config.json as a dict; one ValueError for every reason there is none."""
    unreadable = ValueError(f"LoRA adapter {lora_path!r}: no such folder, or it has no {CONFIG_FILE} that can be "
                            "read as a JSON object; give a PEFT adapter folder.")
    if not isinstance(lora_path, str) or len(lora_path) > MAX_LORA_PATH_CHARS:
        raise ValueError(f"LoRA adapter path must be text of at most {MAX_LORA_PATH_CHARS} characters.")
    try:
        path = Path(lora_path).expanduser() / CONFIG_FILE
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RuntimeError):  # missing, a file, no permission, NUL byte, not JSON, ...
        raise unreadable from None
    if not isinstance(config, dict):
        raise unreadable
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {peft_type!r} is not a LoRA adapter.")
    return config


def _check_unsupported(config: dict, lora_path: str) -> None:
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {lora_path!r} uses DoRA (use_dora), which minivllm does not support.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {lora_path!r} trains biases (bias={config['bias']!r}): only "
                         "bias='none' is supported.")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {lora_path!r} saves whole modules ({config['modules_to_save']}): "
                         "not supported.")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {lora_path!r}: fan_in_fan_out (GPT-2 style Conv1D) is not supported.")


def _target_modules(config: dict, lora_path: str) -> tuple[str, ...]:
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"LoRA adapter {lora_path!r}: target_modules must list module names, got "
                         f"{config.get('target_modules')!r}.")
    unknown = sorted(set(targets) - set(SUPPORTED_MODULES))
    if unknown:
        raise ValueError(f"LoRA adapter {lora_path!r} targets unsupported modules {unknown}; supported: "
                         f"{list(SUPPORTED_MODULES)}.")
    return tuple(targets)


def _read_header(folder: Path, lora_path: str) -> tuple[dict, int]:
    """The safetensors header (8-byte little-endian length, then JSON) and where the data starts."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise ValueError(f"LoRA adapter {lora_path!r} has no {WEIGHTS_FILE} (found {found}); only the "
                         "safetensors format is read.")
    with open(path, "rb") as f:
        raw = f.read(_HEADER_LENGTH_BYTES)
        length = struct.unpack("<Q", raw)[0] if len(raw) == _HEADER_LENGTH_BYTES else -1
        if not 0 < length <= path.stat().st_size - _HEADER_LENGTH_BYTES:
            raise ValueError(f"{path}: not a safetensors file (bad header).")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not a safetensors file ({error}).") from error
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object).")
    return header, _HEADER_LENGTH_BYTES + length


def _read_shapes(header: dict, lora_path: str) -> dict[str, tuple[int, str, str, tuple[int, ...]]]:
    """safetensors name -> (layer, module, "A" or "B", shape), for the header's LoRA tensors."""
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} has no shape in the safetensors header.")
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {lora_path!r}: unexpected tensor {name!r} (expected "
                             "'...layers.N.self_attn|mlp.<module>.lora_A|lora_B.weight').")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        tensors[name] = (layer, module, which, tuple(info["shape"]))
    if not tensors:
        raise ValueError(f"LoRA adapter {lora_path!r}: {WEIGHTS_FILE} holds no LoRA weights.")
    return tensors


def _check_shapes(tensors: dict, r: int, shapes: dict[str, tuple[int, int]], num_layers: int,
                  targets: tuple[str, ...], lora_path: str) -> None:
    pairs: dict[tuple[int, str], set[str]] = {}
    for name, (layer, module, which, shape) in tensors.items():
        if module not in targets:
            raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} is for {module!r}, which is not "
                             f"in target_modules {list(targets)}.")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {lora_path!r}: tensor {name!r} is for layer {layer}, but the base "
                             f"model has {num_layers} layers.")
        out_features, in_features = shapes[module]
        expected = (r, in_features) if which == "A" else (out_features, r)
        if shape != expected:
            raise ValueError(f"LoRA adapter {lora_path!r}: {name} has shape {list(shape)}, expected "
                             f"{list(expected)} for this base model (r={r}); was it trained on another model?")
        pairs.setdefault((layer, module), set()).add(which)
    for (layer, module), found in pairs.items():
        if found != {"A", "B"}:
            raise ValueError(f"LoRA adapter {lora_path!r}: layer {layer} {module} has lora_{found.pop()} "
                             "without its partner.")


def _check_values(path: Path, header: dict, data_start: int, lora_path: str) -> None:
    """Each tensor: a floating-point dtype, a byte range that matches its shape and lies within
    the file (a truncated file fails here), and finite values only."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info.get("dtype")
            if dtype not in _FLOAT_DTYPES:
                raise ValueError(f"LoRA adapter {lora_path!r}: {name} has dtype {dtype!r}; LoRA weights must be "
                                 f"floating point ({', '.join(_FLOAT_DTYPES)}).")
            itemsize, exponent_bits = _FLOAT_DTYPES[dtype]
            offsets = info.get("data_offsets")
            expected = math.prod(info["shape"]) * itemsize
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                    or offsets[1] - offsets[0] != expected or offsets[0] < 0
                    or data_start + offsets[1] > file_size):
                raise ValueError(f"LoRA adapter {lora_path!r}: {name}'s data is truncated or does not match its "
                                 f"shape {info['shape']} ({WEIGHTS_FILE} is damaged).")
            f.seek(data_start + offsets[0])
            bits = np.frombuffer(f.read(expected), dtype=_UINT_OF_SIZE[itemsize])
            if np.any((bits & exponent_bits) == exponent_bits):
                raise ValueError(f"LoRA adapter {lora_path!r}: {name} holds NaN or infinite values.")
