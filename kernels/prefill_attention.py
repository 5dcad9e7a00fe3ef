"""Paged prefill attention in Triton: new tokens attend to the cached context and to themselves.

Mirrors `vllm/attention/ops/prefix_prefill.py`. Shapes (the kernel-API contract):
    query, out          [num_tokens, num_heads, head_dim]  (new tokens of all sequences, back to back)
    key/value_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables        [num_seqs, max_blocks_per_seq] int32
    query_start_loc     [num_seqs + 1] int32, sequence i owns query[start[i]:start[i+1]]
    seq_lens            [num_seqs] int32, context + new tokens
A sequence has `context = seq_len - query_len` tokens in the cache; new token i sees keys
0 .. context + i (chunked prefill and prefix caching share this mask). Every key and value is
read through the block table (reshape_and_cache wrote the new tokens first), so a prefix hit
or an earlier chunk is never recomputed. FlashAttention-style tiling: a program owns a tile of
query rows and streams K/V tiles with an online softmax in fp32, so the `[query_len, seq_len]`
scores never exist in memory. One program per (query tile, KV head) takes all query heads of
that KV head as its rows (row = token * GROUP_PAD + head): each K/V tile loads once.

The grid depends on num_tokens and num_seqs alone, never on how the tokens split into sequences,
so a CUDA graph captured for one batch shape replays for any batch of that shape. Sequence i's
tiles are numbered from tile_start(i) = query_start_loc[i] // BLOCK_Q + i (one spare tile per
sequence for its partial last one); a program finds its sequence by binary search:

    query_start_loc [0, 40, 41, 41]  BLOCK_Q 32  ->  tile_start [0, 2, 3, 4]
    program 0, 1: sequence 0 (tokens 0-31, 32-39)   2: sequence 1   3: nothing (a 0-token sequence)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x * log2(e))
MIN_DOT_SIZE = 16  # tl.dot needs every tile dimension >= 16
# Dots in true fp32 for fp32 operands (input_precision="ieee", not TF32): see paged_attention.py.
BLOCK_M = 64  # query rows (tokens x heads of one KV group) per program
BLOCK_N = 32  # keys per loop iteration (may span several cache blocks)
NUM_WARPS = 4
NUM_STAGES = 2


# Batch-dependent int arguments: not specialized (why: kernels/paged_attention.py, v1).
@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def _paged_prefill_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr,
    query_start_loc_ptr, seq_lens_ptr, num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_bts,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; rows = BLOCK_Q * GROUP_PAD
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last sequence whose first tile is at or before this one (tile_start is increasing).
    lo, hi = tl.full((), 0, tl.int32), num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached before this step
    first_token = (tile - query_start // BLOCK_Q - seq) * BLOCK_Q
    # A sequence's spare tile, and every tile past the last sequence, is idle.
    if first_token < query_len:
        # Rows of this program: BLOCK_Q new tokens x GROUP_PAD query heads (head-minor).
        offs_row = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = first_token + offs_row // GROUP_PAD  # index among the new tokens
        head = kv_head * GROUP_SIZE + offs_row % GROUP_PAD
        row_mask = (token < query_len) & (offs_row % GROUP_PAD < GROUP_SIZE)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = offs_d < HEAD_DIM
        q_offs = ((query_start + token).to(tl.int64)[:, None] * stride_qt
                  + head[:, None] * stride_qh + offs_d[None, :] * stride_qd)
        q_mask = row_mask[:, None] & dim_mask[None, :]
        q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)

        query_pos = context_len + token  # absolute position of each row's token: its last visible key
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

        block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
        kv_head_offset = kv_head.to(tl.int64) * stride_ch
        # Keys past the tile's last token are masked for every row: stop the loop there.
        last_token = tl.minimum(first_token + BLOCK_Q, query_len) - 1
        key_end = context_len + last_token + 1
        for key_start in range(0, key_end, BLOCK_N):
            offs_k = key_start + tl.arange(0, BLOCK_N)  # key positions
            key_mask = offs_k < key_end
            block = tl.load(block_table_ptr + offs_k // BLOCK_SIZE, mask=key_mask, other=0)
            kv_row = block.to(tl.int64) * stride_cb + (offs_k % BLOCK_SIZE) * stride_ct  # 64-bit
            kv_offs = kv_head_offset + kv_row[:, None] + offs_d[None, :] * stride_cd
            kv_mask = key_mask[:, None] & dim_mask[None, :]
            k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0)

            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [rows, BLOCK_N] fp32, base 2
            # Causal over the new tokens, full over the context. Key 0 is visible to every
            # row, so no row is all -inf on the first tile (no NaN from -inf - -inf).
            visible = (offs_k[None, :] <= query_pos[:, None]) & key_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / l_i[:, None]
        out_offs = ((query_start + token).to(tl.int64)[:, None] * stride_ot
                    + head[:, None] * stride_oh + offs_d[None, :] * stride_od)
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Prefill attention over the paged cache (see the module docstring). Returns out like query."""
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError("query must be [num_tokens, num_heads, head_dim] and key_cache "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if num_heads % num_kv_heads != 0 or head_dim != cache_head_dim:
        raise ValueError(f"query [*, {num_heads}, {head_dim}] does not fit a cache of "
                         f"{num_kv_heads} KV heads of dim {cache_head_dim}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc needs num_seqs + 1 entries and block_tables num_seqs rows")

    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group_size = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group_size)
    # BLOCK_M rows = BLOCK_Q tokens x group_pad heads, and at least 16 rows for tl.dot.
    block_q = max(1, BLOCK_M // group_pad, MIN_DOT_SIZE // group_pad)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)  # tile_start(num_seqs) at most
    _paged_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, num_seqs,
        scale * LOG2E,
        *query.stride(), *out.stride(), *key_cache.stride(), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP_SIZE=group_size, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
