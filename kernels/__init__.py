"""The attention and cache ops, imported as `minivllm.kernels` (pyproject's package-dir).

Five ops, each with one signature for every backend:

    reshape_and_cache        new keys/values into their slots of the paged cache
    paged_attention_decode   one query token per sequence over its cached keys (v1 / v2 split-KV)
    paged_prefill_attention  new tokens over their cached context and themselves (causal)
    copy_blocks              copy-on-write of whole blocks, every layer
    swap_blocks              blocks between the GPU and CPU pools

Backend "torch" is `reference.py` (the spec, and the CPU backend), "triton" the Triton kernels.
Those are imported inside `get_ops("triton")`, never here: a CPU-only machine runs them in
Triton's interpreter, which `TRITON_INTERPRET=1` switches on only before triton's first import,
and a Mac has no triton at all.
"""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

BACKENDS = ("torch", "triton")  # built in; `register_backend` adds more by name
OP_NAMES = ("reshape_and_cache", "paged_attention_decode", "paged_prefill_attention", "copy_blocks",
            "swap_blocks")
_REGISTERED_BACKENDS: dict[str, str | ModuleType] = {}  # name -> the module holding its five ops
# Backends a CUDA graph can capture: no host synchronisation, no shapes that depend on the
# data. The PyTorch references fail both (boolean masks, loops over sequences).
_GRAPH_SAFE_BACKENDS = {"triton"}


def register_backend(name: str, module_path: str | ModuleType, cuda_graphs: bool = False) -> None:
    """Make `attention_backend=name` use the five ops (`OP_NAMES`) of `module_path`, imported
    when an engine first asks for it (vLLM selects attention backends by name the same way).
    A module object (a lab's ops, built in a notebook) serves engines of this process only;
    workers in other processes import the module by its path string.
    `cuda_graphs=True` declares the ops capturable: no host sync, grids from tensor shapes
    alone, and sequences of 0 tokens allowed (a graph pads its batch); otherwise every step
    runs eagerly."""
    if name in BACKENDS:
        raise ValueError(f"{name!r} is a built-in backend; choose another name.")
    _REGISTERED_BACKENDS[name] = module_path
    if cuda_graphs:
        _GRAPH_SAFE_BACKENDS.add(name)
    else:
        _GRAPH_SAFE_BACKENDS.discard(name)


def supports_cuda_graphs(backend: str) -> bool:
    return backend in _GRAPH_SAFE_BACKENDS


def available_backends() -> tuple[str, ...]:
    return BACKENDS + tuple(_REGISTERED_BACKENDS)


def get_ops(backend: str) -> SimpleNamespace:
    """The five ops of `backend`, by name (`OP_NAMES`)."""
    if backend == "triton":
        from minivllm.kernels.cache_ops import copy_blocks, swap_blocks
        from minivllm.kernels.paged_attention import paged_attention_decode
        from minivllm.kernels.prefill_attention import paged_prefill_attention
        from minivllm.kernels.reshape_and_cache import reshape_and_cache

        return SimpleNamespace(
            reshape_and_cache=reshape_and_cache, paged_attention_decode=paged_attention_decode,
            paged_prefill_attention=paged_prefill_attention, copy_blocks=copy_blocks,
            swap_blocks=swap_blocks)
    if backend not in available_backends():
        raise ValueError(
            f"unknown kernel backend {backend!r}; choose one of {available_backends()}")
    module = _REGISTERED_BACKENDS.get(backend, f"{__name__}.reference")
    if isinstance(module, str):
        module = importlib.import_module(module)
    missing = [name for name in OP_NAMES if not hasattr(module, name)]
    if missing:
        raise ValueError(f"backend {backend!r} ({module.__name__}) lacks ops {missing}.")
    return SimpleNamespace(**{name: getattr(module, name) for name in OP_NAMES})
