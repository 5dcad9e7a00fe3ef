"""Multi-LoRA shrink and expand in Triton: each row of a mixed batch through its own adapter,
one launch per op. Mirrors `vllm/lora/ops/sgmv_shrink.py` / `sgmv_expand.py` in the segmented
form of vLLM's newer `lora_shrink` / `lora_expand`; the spec, shapes and `LoRAMapping` are in
`lora_reference.py`. Rows are grouped by slot (`sorted_token_ids`); program (m, s) takes the
m-th block of BLOCK_M rows OF SLOT s, returning at once past its slot's row count:

    grid = (cdiv(T, BLOCK_M) [x cdiv(N, BLOCK_N) for expand], L)

so every program multiplies a `[BLOCK_M, K]` tile of rows sharing ONE adapter by its matrix
with `tl.dot`, and base-model rows (slot -1) are never visited. The grid depends only on T
and L, never on the mapping: a CUDA graph captured once replays for any mix of adapters.
Split-K: below `_SPLIT_K_MAX_TOKENS` rows the shrink cuts K into P chunks (a third grid axis),
each writing its own plane of h `[P, T, S*R]`; expand adds the planes as it loads them, so no
atomics (a graph replay gives the eager bits) and no launch zeroes or sums a buffer: two
launches per LoRA layer, whatever the number of slices or adapters. Operands in the model's
dtype (fp32 with `input_precision="ieee"`, no TF32), accumulated in fp32; expand rounds h to
B's dtype first, as vLLM's does. Importing this module imports triton: import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.lora_reference import LoRAMapping

_BLOCK_K = 64
_BLOCK_N = 64
_MIN_DOT = 16  # tl.dot wants every dimension at least 16
_SMALL_BATCH = 128  # up to this many rows, 16-row tiles (decode); above, 64 (prefill)
_SPLIT_K_MAX_TOKENS = 512  # split shrink's K loop only for batches up to this many rows
_K_PER_SPLIT = 256  # about this much of K per program when split
_MAX_SPLIT_K = 16


def _block_m(num_tokens: int) -> int:
    return _MIN_DOT if num_tokens <= _SMALL_BATCH else 64


@triton.jit
def _rows_of_slot(sorted_ptr, count_ptr, start_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """This program's rows: the pid_m-th block of the rows of `slot` (mask: which exist)."""
    count = tl.load(count_ptr + slot)
    start = tl.load(start_ptr + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(sorted_ptr + start + offs, mask=mask, other=0)
    return rows, mask, count


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ptr, count_ptr, start_ptr, K, R, k_per_split,
                   stride_xm, stride_xk, stride_al, stride_ar, stride_ak, stride_op, stride_om, stride_or,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (m, slot, split): rows of tile m of `slot`, K range [split * k_per_split, ...)
    -> plane `split` of out."""
    pid_m, slot, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, row_mask, count = _rows_of_slot(sorted_ptr, count_ptr, start_ptr, slot, pid_m, BLOCK_M)
    if pid_m * BLOCK_M >= count:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        # x tile [BLOCK_M, BLOCK_K]: gathered rows (they need not be neighbours in the batch).
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        # A^T tile [BLOCK_K, BLOCK_R] of this slot's adapter (ranks past R read as 0).
        a = tl.load(a_ptr + slot * stride_al + r[None, :] * stride_ar + k[:, None] * stride_ak,
                    mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x, a, input_precision="ieee")
    out_ptrs = out_ptr + split * stride_op + rows[:, None] * stride_om + r[None, :] * stride_or
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


# Batch-dependent int arguments: not specialized (why: kernels/paged_attention.py, v1).
@triton.jit(do_not_specialize=["num_planes"])
def _expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, count_ptr, start_ptr, N, R, bound1, bound2, num_planes,
                   stride_hp, stride_hm, stride_hr, stride_bl, stride_bn, stride_bk, stride_ym, stride_yn,
                   NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (m * n_blocks + n, slot): y[rows, n-block] += sum over slices s of
    h_s[rows] @ B[slot, n-block columns of slice s]^T (slice s: columns [bound_s, bound_s+1))."""
    pid, slot = tl.program_id(0), tl.program_id(1)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n_blocks, pid % num_n_blocks
    rows, row_mask, count = _rows_of_slot(sorted_ptr, count_ptr, start_ptr, slot, pid_m, BLOCK_M)
    if pid_m * BLOCK_M >= count:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    b = tl.load(b_ptr + slot * stride_bl + n[None, :] * stride_bn + r[:, None] * stride_bk,
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)                # B^T [BLOCK_R, BLOCK_N]
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        lo = tl.where(s == 0, 0, tl.where(s == 1, bound1, bound2))
        hi = tl.where(s == NUM_SLICES - 1, N, tl.where(s == 0, bound1, bound2))
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p in range(num_planes):  # shrink's split-K partials
            h += tl.load(h_ptr + p * stride_hp + rows[:, None] * stride_hm + (s * R + r)[None, :] * stride_hr,
                         mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        in_slice = (n >= lo) & (n < hi)
        b_s = tl.where(in_slice[None, :], b, 0.0).to(b.dtype)  # only slice s's columns use h_s
        delta += tl.dot(h.to(b.dtype), b_s, input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None] * stride_ym + n[None, :] * stride_yn
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    # Each row belongs to one slot, so no two programs write the same element.
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _rank_block(rank: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(rank))


def _split_k(num_tokens: int, k: int) -> int:
    if num_tokens > _SPLIT_K_MAX_TOKENS:
        return 1  # a prefill has tiles enough to fill the GPU
    return max(1, min(_MAX_SPLIT_K, triton.cdiv(k, _K_PER_SPLIT)))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """Same contract as `lora_reference.lora_shrink`, with P >= 1 planes."""
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a.shape
    block_m = _block_m(num_tokens)
    split_k = _split_k(num_tokens, k)
    # K per split, a whole number of BLOCK_K tiles (so no split is empty).
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), _BLOCK_K) * _BLOCK_K
    split_k = triton.cdiv(k, k_per_split)
    h = torch.empty(split_k, num_tokens, rank, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_m), num_slots, split_k)
    _shrink_kernel[grid](x, lora_a, h, mapping.sorted_token_ids, mapping.num_tokens_per_slot,
                         mapping.slot_start, k, rank, k_per_split, x.stride(0), x.stride(1), *lora_a.stride(),
                         *h.stride(), BLOCK_M=block_m, BLOCK_R=_rank_block(rank), BLOCK_K=_BLOCK_K)
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slice_bounds: tuple[int, ...],
                mapping: LoRAMapping) -> None:
    """Same contract as `lora_reference.lora_expand` (at most three slices: q, k, v)."""
    num_planes, num_tokens, _ = h.shape
    num_slots, n, rank = lora_b.shape
    num_slices = len(slice_bounds) - 1
    if not 1 <= num_slices <= 3 or slice_bounds[0] != 0 or slice_bounds[-1] != n:
        raise ValueError(f"slice_bounds {slice_bounds} must run from 0 to {n} in one to three slices.")
    inner = list(slice_bounds[1:-1]) + [n] * (3 - num_slices)  # bound1, bound2 (unused ones: N)
    block_m = _block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(n, _BLOCK_N), num_slots)
    _expand_kernel[grid](h, lora_b, y, mapping.sorted_token_ids, mapping.num_tokens_per_slot,
                         mapping.slot_start, n, rank, inner[0], inner[1], num_planes, *h.stride(),
                         *lora_b.stride(), y.stride(0), y.stride(1),
                         NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_R=_rank_block(rank))
