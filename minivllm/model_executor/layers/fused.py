"""Where the decoder's small elementwise ops run as single fused Triton kernels.

On a CUDA tensor, `RMSNorm`, `SiluAndMul` and `RotaryEmbedding` hand their work to
`minivllm.kernels.fused_ops` (one kernel each instead of chains of 2-17 small ones; see that
module for why that matters at decode time), and the sampler's greedy rows go to
`minivllm.kernels.sampling` (one pass over the logits). On the CPU, and when switched off, they run the
PyTorch code, which is the readable spec and what the CPU parity tests exercise.

Switch them off with the environment variable `MINIVLLM_FUSED_OPS=0`, or at run time with
`minivllm.model_executor.layers.fused.ENABLED = False` (before the engine captures its CUDA
graphs), e.g. to measure before/after in a notebook.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

FUSED_OPS_ENV = "MINIVLLM_FUSED_OPS"
ENABLED = os.environ.get(FUSED_OPS_ENV, "1") != "0"


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused-ops module when x is on a CUDA device and fusion is on; else None."""
    if not (ENABLED and x.is_cuda):
        return None
    from minivllm.kernels import fused_ops as module  # imports triton: only ever on a GPU

    return module


def fused_sampling(x: torch.Tensor) -> ModuleType | None:
    """The Triton sampling module when x is on a CUDA device and fusion is on; else None."""
    if not (ENABLED and x.is_cuda):
        return None
    from minivllm.kernels import sampling as module  # imports triton: only ever on a GPU

    return module
