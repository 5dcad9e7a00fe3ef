"""Fused elementwise ops of the decoder layer, in Triton: RMSNorm (+ residual add), SiLU-and-mul,
rotary embedding.

Why: in eager PyTorch each of these is a chain of small kernels (RMSNorm with its residual
add: add, cast, square, mean, rsqrt, multiply, cast, scale = 8 launches; rotary: a gather,
two casts, and six arithmetic ops plus a concatenation for each of q and k). At decode time
the tensors are tiny (256 tokens x 1024 features), so every launch costs more than its work:
about 60 kernels per layer, 1,700 per step for Qwen3-0.6B, some 3-5 µs each even inside a
CUDA graph. Each function here is one kernel that reads its inputs once and writes its
outputs once, bringing a layer to about 14 kernels.

Every function matches the PyTorch layer it replaces bit for bit in fp32. In bf16 the
norms and SiLU round to the input dtype exactly where the PyTorch code does (after the
residual add, before the RMSNorm weight). The rotary kernel asks for the same roundings
(after each product), but the compiled kernel keeps the products in fp32 (measured on an
H100: Triton folds the bf16 round trip away), so its bf16 outputs may differ from PyTorch's
by one bf16 step; that is rounding, not a different formula, and fp32 agrees exactly.

The layers (`minivllm.model_executor.layers`) call these from their `forward_triton`, bound when
the model is built for the "triton" backend (`model_executor/custom_op.py`); their
`forward_native` is the PyTorch code (before/after comparisons: `CustomOp.use_backend`).
Importing this module imports triton: import it lazily, as `get_ops("triton")` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NORM_WARPS = 4
_SILU_BLOCK = 1024


# --------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    inner, stride_x0, stride_x1, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """One row of N features per program. Rows of x are addressed as [outer, inner] so a
    strided 3-D view (tokens x heads x head_dim, e.g. q inside the fused qkv output) needs no
    copy: row r sits at (r // inner) * stride_x0 + (r % inner) * stride_x1."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + (row // inner) * stride_x0 + (row % inner) * stride_x1 + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the add rounds, as in PyTorch
        tl.store(residual_out_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / N
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(dtype)  # cast back before the weight (HF)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x `[..., N]` (2-D, or a 3-D view with unit last stride).

    With `residual` ([rows, N], contiguous): returns (norm(x + residual), x + residual), as
    `RMSNorm.forward(x, residual)`. Without: returns norm(x), shaped like x (contiguous).
    """
    n = x.shape[-1]
    x3 = x.view(x.shape[0], 1, n) if x.dim() == 2 else x
    if x3.dim() != 3 or x3.stride(-1) != 1:
        raise ValueError(f"rms_norm wants a 2-D or 3-D tensor with unit last stride, got {tuple(x.shape)}.")
    outer, inner = x3.shape[0], x3.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if residual is not None and not (residual.is_contiguous() and x.dim() == 2):
        raise ValueError("rms_norm with a residual wants 2-D x and a contiguous residual.")
    if outer * inner:
        _rms_norm_kernel[(outer * inner,)](
            out, residual_out, x3, residual if residual is not None else x3, weight,
            inner, x3.stride(0), x3.stride(1), n, n, eps,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None, num_warps=_NORM_WARPS,
        )
    return (out, residual_out) if residual is not None else out


# --------------------------------------------------------------------------- SiLU and mul
@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr):
    """out[row, j] = silu(x[row, j]) * x[row, D + j] for one row and BLOCK columns."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds to the input dtype
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[rows, 2 * D]` (gate half, then up half) -> silu(gate) * up `[rows, D]`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul wants a 2-D tensor with unit last stride, got {tuple(x.shape)}.")
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(d, _SILU_BLOCK))](out, x, x.stride(0), d, d, BLOCK=_SILU_BLOCK)
    return out


# --------------------------------------------------------------------------- rotary embedding
@triton.jit
def _rotary_kernel(
    out_ptr, x_ptr, positions_ptr, cos_sin_ptr,
    num_heads, stride_x0, stride_x1, stride_cs,
    HALF: tl.constexpr,
):
    """Rotate one head of one token: pairs (x[i], x[i + HALF]) by the angle of its position.
    cos_sin is the fp32 table [max_position, 2 * HALF] (cos, then sin). The casts ask for
    the PyTorch code's rounding of each product (x1 * cos - x2 * sin in bf16); the CUDA
    compiler drops them, the interpreter keeps them (see the module docstring)."""
    token = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    i = tl.arange(0, HALF)
    src = x_ptr + token * stride_x0 + head * stride_x1
    x1 = tl.load(src + i)
    x2 = tl.load(src + HALF + i)
    dtype = x1.dtype
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cs + i).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + i).to(dtype).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    dst = out_ptr + (token * num_heads + head) * 2 * HALF
    tl.store(dst + i, o1.to(dtype))
    tl.store(dst + HALF + i, o2.to(dtype))


def rotary_supported(head_dim: int) -> bool:
    """tl.arange needs a power-of-two length: half the head dim (64 and 128 both qualify)."""
    return head_dim >= 2 and (head_dim // 2) & (head_dim // 2 - 1) == 0 and head_dim % 2 == 0


def rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, num_heads, head_dim]` (unit last stride) rotated by `positions`;
    returns a new contiguous tensor of the same shape. cos_sin_cache: `[max_position, head_dim]`."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1 or not rotary_supported(head_dim) or not cos_sin_cache.is_contiguous():
        raise ValueError("rotary wants x with unit last stride, head_dim = 2^k and a contiguous cache.")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens * num_heads,)](
            out, x, positions, cos_sin_cache, num_heads, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            HALF=head_dim // 2, num_warps=1,
        )
    return out
