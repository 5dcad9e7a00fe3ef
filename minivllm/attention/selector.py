"""Which implementation of the PagedAttention ops runs (vLLM v0's `get_attn_backend`):

    "triton"  the Triton kernels (`kernels/*.py`): the default on a GPU
    "torch"   the PyTorch references (`kernels/reference.py`): the default on a CPU
"""

from __future__ import annotations

import os

import torch

from minivllm.kernels import available_backends

# On a CPU Triton runs only in its interpreter, switched on by this before triton is imported.
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def get_attn_backend(name: str | None, device: torch.device | str) -> str:
    """The backend name to use on `device`: `name` if given and usable, else the default.

    >>> get_attn_backend(None, "cpu")
    'torch'
    """
    device_type = torch.device(device).type
    if name is None:
        return "triton" if device_type == "cuda" else "torch"
    if name not in available_backends():
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()} "
                         "(minivllm.kernels.register_backend adds one).")
    if name == "triton" and device_type != "cuda" and os.environ.get(TRITON_INTERPRET_ENV) != "1":
        raise ValueError(f"the triton backend needs a CUDA device; on a CPU it runs only in Triton's "
                         f"interpreter: set {TRITON_INTERPRET_ENV}=1 before importing triton "
                         "(slow, for learning), or use the 'torch' backend.")
    return name
