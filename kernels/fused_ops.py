"""Fused elementwise ops of the decoder layer, in Triton: RMSNorm (+ residual add), SiLU-and-mul,
rotary embedding, and the attention prologue (q/k norm + rotary + KV-cache write) as one.

Mirrors vLLM's `csrc/layernorm_kernels.cu`, `activation_kernels.cu` and
`pos_encoding_kernels.cu`. Each function is one kernel that reads its inputs once and writes
its outputs once, where eager PyTorch launches a chain of small kernels (RMSNorm with its
residual add: 8). At decode time the tensors are tiny (`[num_tokens, hidden_size]`), so a
launch costs more than its work; with `qk_norm_rope_and_cache` (everything between the qkv
projection and attention) and the split-KV decode merging its own partials, a Qwen3 layer is
9 kernels: norm, qkv, prologue, attention, o_proj, norm, gate_up, SiLU, down.

Every function matches the PyTorch layer it replaces bit for bit in fp32. In bf16 the norms
and SiLU round to the input dtype where the PyTorch code does (after the residual add, before
the RMSNorm weight); the rotary kernel asks for the same roundings, but Triton keeps its
products in fp32, so its bf16 outputs may differ from PyTorch's by one bf16 step.

Called from the layers' `forward_triton` (`model_executor/custom_op.py`; `forward_native` is
the PyTorch code) and from `LlamaAttention.forward_triton`. Importing this module imports
triton: import it lazily, as `get_ops("triton")` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.launch import pdl_options, signal_dependents, wait_for_inputs

_NORM_WARPS = 4
_SILU_BLOCK = 1024


# --------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    inner, stride_x0, stride_x1, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    """One row of N features per program. Rows of x are addressed as [outer, inner] so a
    strided 3-D view (tokens x heads x head_dim, e.g. q inside the fused qkv output) needs no
    copy: row r sits at (r // inner) * stride_x0 + (r % inner) * stride_x1."""
    signal_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + (row // inner) * stride_x0 + (row % inner) * stride_x1 + cols, mask=mask, other=0.0)
    add_residual_and_norm(x, row, cols, mask, out_ptr, residual_out_ptr, residual_ptr, weight_ptr,
                          stride_r, stride_o, eps, N, HAS_RESIDUAL)


@triton.jit
def add_residual_and_norm(x, row, cols, mask, out_ptr, residual_out_ptr, residual_ptr, weight_ptr,
                          stride_r, stride_o, eps, N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Row `row` of the output from its loaded x `[BLOCK]`: x + residual (stored, rounded to x's
    dtype as PyTorch's add rounds), then RMSNorm times the weight. Also the last step of
    `custom_all_reduce`'s kernel."""
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_o + cols, x, mask=mask)
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
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
            num_warps=_NORM_WARPS, **pdl_options(x),
        )
    return (out, residual_out) if residual is not None else out


# --------------------------------------------------------------------------- SiLU and mul
@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[row, j] = silu(x[row, j]) * x[row, D + j] for one row and BLOCK columns."""
    signal_dependents(PDL)
    wait_for_inputs(PDL)
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
        _silu_and_mul_kernel[(rows, triton.cdiv(d, _SILU_BLOCK))](
            out, x, x.stride(0), d, d, BLOCK=_SILU_BLOCK, **pdl_options(x))
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


# --------------------------------------------------------------------------- q/k norm + rotary + cache write
@triton.jit
def _norm_and_rotate_head(
    src_ptr, weight_ptr, cos_sin_ptr, eps,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """One head `[HEAD_DIM]` at src_ptr: RMSNorm with `weight_ptr` (if HAS_NORM), then rotary
    with the cos/sin row at cos_sin_ptr. Returns the head in the input dtype.

    Rotary pairs feature i with its partner i +- HEAD_DIM/2; instead of splitting the head in
    halves, the head is loaded twice, once in the partner order, so the norm's sum of squares
    runs over the whole head in one reduction, as in `rms_norm` above:
        out[i] = x[i] * cos[i % HALF] - x[i + HALF] * sin[i % HALF]    i <  HALF
        out[i] = x[i] * cos[i % HALF] + x[i - HALF] * sin[i % HALF]    i >= HALF
    The roundings are the PyTorch layers' (RMSNorm, then RotaryEmbedding): fp32 agrees bit
    for bit; in bf16 the compiler may keep the products in fp32 (see the module docstring).
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    first_half = d < HALF
    partner = tl.where(first_half, d + HALF, d - HALF)
    x = tl.load(src_ptr + d)
    xp = tl.load(src_ptr + partner)
    dtype = x.dtype
    if HAS_NORM:
        x32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / HEAD_DIM + eps)
        w = tl.load(weight_ptr + d).to(tl.float32)
        wp = tl.load(weight_ptr + partner).to(tl.float32)
        # Cast back before the weight (HF's RMSNorm), then round the product to the dtype.
        x = ((x32 * inv_rms).to(dtype).to(tl.float32) * w).to(dtype)
        xp = ((xp.to(tl.float32) * inv_rms).to(dtype).to(tl.float32) * wp).to(dtype)
    cos = tl.load(cos_sin_ptr + d % HALF).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + HALF + d % HALF).to(dtype).to(tl.float32)
    x_cos = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    partner_sin = (xp.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return tl.where(first_half, x_cos - partner_sin, x_cos + partner_sin).to(dtype)


@triton.jit
def _qk_norm_rope_cache_kernel(
    query_out_ptr, query_ptr, key_ptr, value_ptr, key_cache_ptr, value_cache_ptr,
    slot_mapping_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch, stride_cs,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (num_tokens, num_heads + num_kv_heads): program (t, h) handles query head h of
    token t, or, for h >= num_heads, KV head h - num_heads: its key (normed, rotated) and its
    value go to the token's cache slot; slot -1 (padding) writes nothing."""
    signal_dependents(PDL)
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    position = tl.load(positions_ptr + token)
    cos_sin_row = cos_sin_ptr + position * stride_cs
    if head < NUM_HEADS:
        q = _norm_and_rotate_head(query_ptr + token * stride_qt + head * stride_qh, q_weight_ptr,
                                  cos_sin_row, eps, HEAD_DIM, HAS_NORM)
        tl.store(query_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + d, q)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            k = _norm_and_rotate_head(key_ptr + token * stride_kt + kv_head * stride_kh, k_weight_ptr,
                                      cos_sin_row, eps, HEAD_DIM, HAS_NORM)
            v = tl.load(value_ptr + token * stride_vt + kv_head * stride_vh + d)
            # slot = block * BLOCK_SIZE + offset (int64: a big cache has > 2**31 elements).
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kv_head * stride_ch + d
            tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty))
            tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty))


def qk_norm_rope_and_cache(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Everything between the qkv projection and attention, in one kernel: Qwen3's per-head
    q/k RMSNorm (skipped when the weights are None, as for Llama), rotary embedding of q and
    k, and the write of k and v into the paged cache. Returns the new query; the rotated keys
    exist only in the cache. Contract and PyTorch spec: `reference.qk_norm_rope_and_cache`.

    query `[num_tokens, num_heads, head_dim]`, key/value `[num_tokens, num_kv_heads, head_dim]`
    (views of the qkv output are fine: unit last stride); key/value_cache `[num_blocks,
    block_size, num_kv_heads, head_dim]`; slot_mapping, positions `[num_tokens]` int64;
    cos_sin_cache `[max_position, head_dim]`. Returns `[num_tokens, num_heads, head_dim]`.

    Why: unfused this is q_norm, k_norm, rotary(q), rotary(k), reshape_and_cache: five
    launches per layer (three for Llama), each moving a few KB at decode time.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if not qk_norm_rope_and_cache_supported(query, key, value, key_cache, cos_sin_cache):
        raise ValueError("qk_norm_rope_and_cache wants head_dim = 2^k, unit last strides, q/k/v and "
                         "cache heads that agree, and a contiguous cos/sin table.")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights, or neither.")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides.")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    has_norm = q_norm_weight is not None
    if num_tokens:
        _qk_norm_rope_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
            out, query, key, value, key_cache, value_cache, slot_mapping, positions, cos_sin_cache,
            q_norm_weight if has_norm else query, k_norm_weight if has_norm else key, eps,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1], HAS_NORM=has_norm,
            num_warps=1, **pdl_options(query),
        )
    return out


def qk_norm_rope_and_cache_supported(query, key, value, key_cache, cos_sin_cache) -> bool:
    """The layouts the kernel reads: head_dim a power of two (tl.arange), unit last strides,
    key/value/cache heads alike, and a cos/sin row per position of head_dim entries."""
    head_dim = query.shape[-1]
    return (query.dim() == key.dim() == value.dim() == 3 and key.shape == value.shape
            and head_dim >= 2 and head_dim & (head_dim - 1) == 0
            and key.shape[2] == head_dim and tuple(key_cache.shape[2:]) == tuple(key.shape[1:])
            and all(t.stride(-1) == 1 for t in (query, key, value, key_cache))
            and cos_sin_cache.is_contiguous() and cos_sin_cache.shape[-1] == head_dim)
