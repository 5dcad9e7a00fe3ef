"""A model from a Hugging Face checkpoint: the class, the dtype, the weights (vLLM's
`vllm/model_executor/model_loader/`). `get_model(ModelConfig("path/or/hub-id"), "cpu")`.

Weights come from `*.safetensors` in a local directory or the Hugging Face cache
(`snapshot_download`); a sharded checkpoint lists its files in `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from minivllm.attention import get_attn_backend
from minivllm.model_executor.all_reduce_fusion import fuse_all_reduce_into_norms
from minivllm.model_executor.models import get_model_class

logger = logging.getLogger(__name__)

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# What snapshot_download fetches: config, tokenizer files and safetensors weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt"]


def get_model(model_config: Any, device: torch.device | str = "cpu",
              dtype: torch.dtype | str | None = None, attn_backend: str | None = None) -> nn.Module:
    """The model of `model_config`, weights loaded, in eval mode, on `device`. dtype: None for
    `model_config.dtype` (`resolve_dtype`); attn_backend: None for the device's default."""
    device = torch.device(device)
    hf_config = model_config.hf_config
    dtype = resolve_dtype(model_config.dtype if dtype is None else dtype, hf_config, device)
    backend = get_attn_backend(attn_backend, device)
    model_class = get_model_class(getattr(hf_config, "architectures", None))
    _warn_unsupported_features(hf_config, model_config.max_model_len)
    # Built straight on the device in the target dtype (the rotary table asks for fp32).
    with default_dtype(dtype), device:
        model = model_class(hf_config, attn_backend=backend)
    model_dir = resolve_model_dir(model_config.model, model_config.revision)
    loaded = model.load_weights(iterate_weights(model_dir))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for {missing}.")
    fuse_all_reduce_into_norms(model)  # TP > 1: each all-reduce moves into the norm after it
    return model.eval()


def resolve_dtype(dtype: torch.dtype | str | None, hf_config: Any,
                  device: torch.device | str) -> torch.dtype:
    """An explicit dtype (or its name) wins. "auto" or None: float32 on a CPU (no fast bf16
    matmul; exact parity with transformers); on a GPU the checkpoint's dtype, but bf16 (fp16
    without bf16) for an fp32 checkpoint, as vLLM does."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}.")
        return getattr(torch, dtype)
    if torch.device(device).type == "cpu":
        return torch.float32
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)  # transformers 4.x
    checkpoint_dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(checkpoint_dtype, torch.dtype) or checkpoint_dtype == torch.float32:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return checkpoint_dtype


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Build tensors in `dtype` inside the block (parameters are created in the default dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local checkpoint directory as is; otherwise a hub id, downloaded or found in the cache."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # only needed for hub ids

    try:
        # Online it downloads what is missing; offline it falls back to the local cache.
        return Path(snapshot_download(model, revision=revision, allow_patterns=_HUB_PATTERNS))
    except Exception as err:  # network, auth, not-found: one clear message for all
        raise ValueError(f"cannot load model {model!r}: it is not a local directory, and the Hugging Face hub "
                         f"could not provide it (offline and not in the cache, or no such repo): {err}") from err


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards named by the index, or the single file."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SAFETENSORS_SINGLE).is_file():
        return [model_dir / SAFETENSORS_SINGLE]
    raise ValueError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {model_dir}; minivllm loads "
                     "safetensors checkpoints only (convert a .bin one with transformers' save_pretrained).")


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, one file open at a time, on the CPU."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _warn_unsupported_features(hf_config: Any, max_model_len: int | None) -> None:
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and (max_model_len or 0) > window:
        logger.warning(
            "the model uses sliding-window attention (window %d), which minivllm does not "
            "implement: sequences longer than the window attend to all tokens.", window)
