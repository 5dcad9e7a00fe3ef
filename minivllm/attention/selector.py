"""Choose the attention backend: which implementation of the PagedAttention ops runs.

    "triton"  the Triton kernels (`kernels/*.py`): the default on a GPU
    "torch"   the PyTorch references (`kernels/reference.py`): the default on a CPU

vLLM v0's `get_attn_backend` picks between FlashAttention, XFormers, FlashInfer, ...; we have
two backends with one contract, so a learner can swap them and compare outputs.
"""

from __future__ import annotations

import os

import torch

from minivllm.kernels import available_backends

# Triton compiles for GPUs; on a CPU it only runs in its interpreter, which is switched on by
# this environment variable before triton is first imported.
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
        raise ValueError(
            "the triton backend needs a CUDA device; on a CPU it runs only in Triton's "
            f"interpreter: set {TRITON_INTERPRET_ENV}=1 before importing triton "
            "(slow, for learning), or use the 'torch' backend."
        )
    return name
