"""PagedAttention kernels, imported as `minivllm.kernels` (see pyproject's package-dir).

Five ops, each written twice with the same signature:

    reshape_and_cache        write new keys/values into their slots of the paged cache
    paged_attention_decode   one query token per sequence over its cached keys (v1 / v2 split-KV)
    paged_prefill_attention  new tokens over cached context + themselves (causal)
    copy_blocks              copy-on-write of whole blocks, every layer
    swap_blocks              move blocks between the GPU and CPU pools

`reference.py` holds the PyTorch versions (the spec, and the CPU backend); the other modules
hold the Triton kernels. `get_ops(backend)` hands out one set or the other.

Importing this package never imports triton: Triton is Linux/GPU only (macOS learners have
none), and on a CPU-only machine it must run in its interpreter, which is switched on by
`TRITON_INTERPRET=1` *before* triton is first imported. So the Triton modules are imported
lazily, inside `get_ops("triton")`.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

BACKENDS = ("torch", "triton")  # built in; `register_backend` adds more by name
# name -> module defining the five ops, for backends registered from outside minivllm.
_REGISTERED_BACKENDS: dict[str, str] = {}
# Backends whose ops a CUDA graph can capture: no host synchronisation, no shapes that depend
# on the data. The PyTorch references fail both (boolean masks, loops over sequences).
_GRAPH_SAFE_BACKENDS = {"triton"}
OP_NAMES = (
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
)


def register_backend(name: str, module_path: str, cuda_graphs: bool = False) -> None:
    """Make `attention_backend=name` use the five ops (`OP_NAMES`) of `module_path`, imported
    when an engine first asks for it (vLLM selects attention backends by name the same way).
    `cuda_graphs=True` declares the ops capturable; otherwise its decode steps run eagerly."""
    if name in BACKENDS:
        raise ValueError(f"{name!r} is a built-in backend; choose another name.")
    _REGISTERED_BACKENDS[name] = module_path
    if cuda_graphs:
        _GRAPH_SAFE_BACKENDS.add(name)
    else:
        _GRAPH_SAFE_BACKENDS.discard(name)


def supports_cuda_graphs(backend: str) -> bool:
    """Whether a CUDA graph can capture `backend`'s ops (the worker runs eagerly otherwise)."""
    return backend in _GRAPH_SAFE_BACKENDS


def available_backends() -> tuple[str, ...]:
    return BACKENDS + tuple(_REGISTERED_BACKENDS)


def get_ops(backend: str) -> SimpleNamespace:
    """The five kernel ops of `backend` ("torch" = PyTorch references, "triton" = Triton kernels).

    >>> ops = get_ops("torch")
    >>> sorted(vars(ops)) == sorted(OP_NAMES)
    True
    """
    if backend == "torch":
        from minivllm.kernels import reference as module

        return SimpleNamespace(**{name: getattr(module, name) for name in OP_NAMES})
    if backend == "triton":
        # Imported here, not at the top: see the module docstring.
        from minivllm.kernels.cache_ops import copy_blocks, swap_blocks
        from minivllm.kernels.paged_attention import paged_attention_decode
        from minivllm.kernels.prefill_attention import paged_prefill_attention
        from minivllm.kernels.reshape_and_cache import reshape_and_cache

        return SimpleNamespace(
            reshape_and_cache=reshape_and_cache,
            paged_attention_decode=paged_attention_decode,
            paged_prefill_attention=paged_prefill_attention,
            copy_blocks=copy_blocks,
            swap_blocks=swap_blocks,
        )
    if backend in _REGISTERED_BACKENDS:
        module = importlib.import_module(_REGISTERED_BACKENDS[backend])
        missing = [name for name in OP_NAMES if not hasattr(module, name)]
        if missing:
            raise ValueError(f"backend {backend!r} ({module.__name__}) lacks ops {missing}.")
        return SimpleNamespace(**{name: getattr(module, name) for name in OP_NAMES})
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {available_backends()}")
