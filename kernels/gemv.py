"""One token times a weight matrix in Triton: the linear layers' matmul at batch-1 decode.

    x    [1, K]        the token's activations
    W    [N, K]        nn.Linear's layout: one output feature per row
    out  [1, N]        x @ W.T (+ bias), accumulated in fp32, rounded once to x's dtype

With one row, a matmul is a matrix-vector product: each weight element is read once and used
once, so the time is the time to stream W from memory. cuBLAS picks GEMM tiles for that row
that leave most of the GPU idle or split K into a second reduction kernel; here each program
takes two whole rows of W, so even a 1024-row projection spreads over 512 programs and every
SM streams. vLLM's ROCm path routes the same case to its skinny-GEMM kernel
(`dispatch_unquantized_gemm` in `vllm/model_executor/layers/utils.py`).
Called from `UnquantizedLinearMethod` (`model_executor/layers/linear.py`).

At batch 1 a GEMV lasts a few microseconds, as long as its launch and ramp-up: on Hopper and
newer GPUs it starts while the kernel before it still runs (`launch.py`), reads its first
weight tile, and waits only before it reads x, that kernel's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.launch import pdl_options, signal_dependents, wait_for_inputs

# (rows per program, K per tile), the fastest of a sweep over Qwen3-0.6B's and Llama-3-8B's
# projections on an H200: narrow programs, many of them, each with wide K tiles in flight.
BLOCK_N, BLOCK_K = 2, 1024


@triton.jit
def _gemv_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    signal_dependents(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]  # 64-bit: N * K may pass 2**31
    # The weight is no earlier kernel's output: its first tile is read before the wait.
    w = tl.load(w_ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
    wait_for_inputs(PDL)  # the kernel that wrote x has finished
    # Partial products stay apart ([BLOCK_N, BLOCK_K]) until the end: one reduction, not one
    # per tile.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        next_cols = k + BLOCK_K + cols  # past K on the last tile: a load with every lane masked
        w = tl.load(w_ptrs + k + BLOCK_K, mask=row_mask[:, None] & (next_cols < K)[None, :], other=0.0)
    y = tl.sum(acc, axis=1)  # [BLOCK_N]; nothing is stored before the wait above
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x `[1, K]`: out `[1, N]` in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    num_rows, k = weight.shape
    out = torch.empty(1, num_rows, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(num_rows, BLOCK_N),)](
        out, x, weight, bias if bias is not None else weight, num_rows, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)),
        num_warps=4, num_stages=3, **pdl_options(x),
    )
    return out
