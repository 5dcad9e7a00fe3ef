"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

At batch-1 decode a kernel lasts a few microseconds, about as long as the GPU takes to launch
the next one. On Hopper and newer GPUs a kernel launched with `launch_pdl=True` may start once
every program of the kernel before it has called `signal_dependents`; it then loads what no
kernel writes (weights) and calls `wait_for_inputs` before it reads an activation or writes
anything. The decoder layer's Triton kernels do both, so each launch hides behind the kernel
before it:

    norm -> qkv GEMV -> q/k norm + rope + cache -> attention -> o GEMV -> norm -> gate_up GEMV
         -> SiLU-and-mul -> down GEMV -> next layer's norm

A kernel that does not signal (cuBLAS, PyTorch's) makes the next one wait for its end as usual.
Only launches over a single token or sequence (batch-1 decode) use it, where
`docs/benchmarks.md` measures it (the batch-1 rows with and without); with many tokens each
kernel runs long past its launch and the linear layers are cuBLAS's. Such a launch is a variant
of its own, compiled when the batch-1 CUDA graph is captured. Each kernel takes a `PDL`
constexpr, False on a CPU, so the interpreter never meets the instructions.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL: an NVIDIA GPU (not ROCm, which torch also calls
    "cuda") of compute capability 9+, compiled (not in Triton's interpreter), and a Triton that
    has it (`tl.extra.cuda.gdc_wait`, which came with `launch_pdl`)."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")


def pdl_options(x: torch.Tensor) -> dict:
    """The launch keywords of a kernel with a `PDL` constexpr over the tokens of x `[num_tokens, ...]`."""
    if x.shape[0] == 1 and programmatic_launch(x.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def signal_dependents(PDL: tl.constexpr):
    """Let the next kernel launch now (it waits in `wait_for_inputs` for this one's end)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernel before has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
