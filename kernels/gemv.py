"""The projections of a small decode batch: y = x W^T + b for a few rows of x, in Triton.

Why: at batch 1 every linear layer is a matrix-VECTOR product. Its cost is reading W once
(Qwen3-0.6B: 1.2 GB a token; Llama-3-8B: 16 GB), so the best kernel streams W at the GPU's
memory bandwidth. cuBLAS picks tiled GEMM kernels for these shapes; profiled at batch 1 on an
H200 (docs/benchmarks.md) they read the 2-13 MB matrices of Qwen3-0.6B at about 1 TB/s, a
fifth of the HBM's bandwidth, and the GEMMs were two thirds of the step.

The kernel: program n owns BLOCK_N consecutive rows of W (output features) and walks K in
BLOCK_K chunks, each row's chunk one contiguous load; every row of x (M <= MAX_ROWS, padded
to a power of two) is multiplied against the same W tile while it is in registers, so W is
read exactly once whatever M is. Products accumulate in fp32 on CUDA cores
(`tl.sum` of a row-wise product, no tensor cores: at M <= 8 there is nothing to gain from
them). Small BLOCK_N keeps the grid large enough to fill the GPU without splitting K, so one
launch writes y directly: no partial buffers, no second kernel.

    x `[M, K]`, weight `[N, K]` (row-major, as nn.Linear stores it), bias `[N]` or None
    -> y `[M, N]` in x's dtype

`skinny_linear` is `F.linear` for `M <= MAX_ROWS` rows; the linear layers call it on the
"triton" backend and fall back to `F.linear` above that. Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # above this, cuBLAS's tiled GEMMs win (W is re-read less than the tiles' gain)
# (BLOCK_N, BLOCK_K, num_warps): chosen with benchmarks/gemv.py on an H200 (docs/benchmarks.md).
CONFIG = (8, 512, 4)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, M_PAD)
    m_mask = m < M
    k_range = tl.arange(0, BLOCK_K)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + k_range
        k_mask = k < K
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)                                   # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)                                   # [M_PAD, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)                    # [M_PAD, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int] = CONFIG) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x `[M, K]` with M <= MAX_ROWS, reading `weight` once."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear takes x [M <= {MAX_ROWS}, K] and weight [N, K]; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}.")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs x and weight contiguous along K.")
    block_n, block_k, num_warps = config
    m_pad = triton.next_power_of_2(num_rows)
    block_k = max(64, block_k // m_pad)  # the [M_PAD, BLOCK_N, BLOCK_K] product must fit in registers
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _skinny_linear_kernel[grid](x, weight, bias if bias is not None else weight, y, num_rows, n, k, x.stride(0),
                                weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, M_PAD=m_pad,
                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y
