"""PagedAttention decode in Triton: one new query token per sequence over its paged KV cache.

Mirrors vLLM's `csrc/attention/attention_kernels.cu` (paged_attention_v1 / v2); the spec is
`paged_attention_decode` in `kernels/reference.py`:
    query, out          [num_seqs, num_heads, head_dim]
    key/value_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables        [num_seqs, max_blocks_per_seq] int32
    seq_lens            [num_seqs] int32
One program per (sequence, KV head) serves that KV head's query heads (GQA): each key and
value is read once. Softmax is online, in fp32; addresses are 64-bit. Programs launch in batch
order (decodes come longest first), a sequence's KV heads side by side. v2 (split-KV) cuts a
context into `num_kv_splits` pieces when too few programs would fill the GPU; the last split
of each pair to finish (an atomic counter) merges the partials, in the same launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minivllm.kernels.launch import pdl_options, signal_dependents, wait_for_inputs

# exp(x) == exp2(x * log2(e)); exp2 is the native instruction, so scores live in base 2.
LOG2E = 1.4426950408889634
# tl.dot needs every tile dimension >= 16: small GQA groups are padded to this many rows.
# Every tl.dot is input_precision="ieee": Triton's fp32 default, TF32, would break fp32 parity
# with transformers (bf16 and fp16 operands still run on tensor cores).
MIN_DOT_SIZE = 16
# (tile tokens, num_warps, num_stages), the fastest of `benchmarks/kernels.py --sweep` (v1) and
# `--latency-sweep` (v2). A tile may span cache blocks; num_stages tiles load at once (pipelining).
V1_CONFIG = (64, 4, 3)  # long programs (whole contexts): big tiles, few iterations
V2_CONFIG = (32, 2, 3)  # more, shorter programs: smaller tiles and fewer warps start sooner

V1_MIN_PROGRAMS_PER_SM = 2  # with this many (sequence, KV head) programs per SM, v1 streams well
TARGET_PROGRAMS_PER_SM = 4  # otherwise split until the grid has this many programs per SM
MIN_TOKENS_PER_SPLIT = 64  # below this a split's fixed cost (load q, write partials) dominates
MAX_KV_SPLITS = 64


# ---- The inner loop of v1 and v2: attend one query-head group over keys [start, end). ----
@triton.jit
def _attend_token_range(
    q,  # [GROUP_PAD, HEAD_DIM_PAD] query heads of this KV head group (padding rows are 0)
    key_cache_ptr, value_cache_ptr, block_table_ptr,  # block_table_ptr: this sequence's row
    kv_head_offset,  # int64: kv_head * stride_ch
    start, end,  # token range of the context to attend (end <= seq_len)
    qk_scale,  # softmax scale * log2(e)
    stride_cb, stride_ct, stride_cd,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Returns (acc [GROUP_PAD, HEAD_DIM_PAD], l [GROUP_PAD], m [GROUP_PAD]), unnormalized, fp32."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = offs_d < HEAD_DIM
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # running sum of p * v

    for tile_start in range(start, end, TILE_N):
        offs_t = tile_start + tl.arange(0, TILE_N)  # logical token positions of this tile
        token_mask = offs_t < end
        # Each token's physical block, then its row in it. The block is widened to int64
        # before the multiply, which overflows int32 on a large cache.
        block = tl.load(block_table_ptr + offs_t // BLOCK_SIZE, mask=token_mask, other=0)
        row = block.to(tl.int64) * stride_cb + (offs_t % BLOCK_SIZE) * stride_ct  # [TILE_N]
        kv_offs = kv_head_offset + row[:, None] + offs_d[None, :] * stride_cd  # [TILE_N, D]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, TILE_N], fp32
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # Online softmax: rescale what we have so far to the new running max.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _load_query_group(
    query_ptr, seq, kv_head, stride_qs, stride_qh, stride_qd,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """The GROUP_SIZE query heads of `kv_head` as a [GROUP_PAD, HEAD_DIM_PAD] tile (padding = 0),
    their head indices [GROUP_PAD], and the mask of real (head, dim) entries for the store."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP_SIZE + offs_g  # query heads kv_head*G .. kv_head*G + G - 1
    offs = seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    mask = (offs_g[:, None] < GROUP_SIZE) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(query_ptr + offs, mask=mask, other=0.0), heads, mask


# ---- v1: one pass. Grid (num_kv_heads, num_seqs); a program walks its whole context. ----
# Triton compiles again for each value class of an int argument (1, a multiple of 16, other):
# arguments that change per batch are exempt, so no run stops mid-way to compile.
@triton.jit(do_not_specialize=["stride_bts"])
def _paged_attention_v1_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_bts,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PDL: tl.constexpr,
):
    signal_dependents(PDL)
    wait_for_inputs(PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q, heads, mask = _load_query_group(
        query_ptr, seq, kv_head, stride_qs, stride_qh, stride_qd,
        GROUP_SIZE, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD,
    )
    acc, l_i, m_i = _attend_token_range(
        q, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bts,
        kv_head.to(tl.int64) * stride_ch, 0, seq_len, qk_scale,
        stride_cb, stride_ct, stride_cd,
        BLOCK_SIZE, TILE_N, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD,
    )
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    out_offs = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + out_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# ---- v2: split-KV. Grid (num_kv_heads, num_seqs, num_kv_splits): a slice of context each ----
@triton.jit
def _split_len(seq_len, num_splits, TILE_N: tl.constexpr):
    """Tokens per split, seq_len / num_splits rounded up to whole tiles: per sequence, on the
    device (no host sync), so a short sequence uses fewer splits."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N


@triton.jit
def _merge_splits(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq, kv_head, num_splits, num_valid,
    stride_os, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """out = sum_s w_s * out_s, w_s = 2**lse_s / sum_s' 2**lse_s', for each query head of the group.

    A head's splits load at once ([SPLITS_PAD, HEAD_DIM_PAD]), one L2 round trip. ".cg" skips
    L1: other SMs wrote the partials, and this SM's L1 may hold a stale line of them."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    split_mask = offs_s < num_valid
    for g in tl.static_range(GROUP_SIZE):
        head = kv_head * GROUP_SIZE + g
        rows = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s  # [SPLITS_PAD]
        lse = tl.load(partial_lse_ptr + rows, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
        weights = tl.exp2(lse - tl.max(lse, axis=0))  # 0 for the splits past the sequence's end
        weights = weights / tl.sum(weights, axis=0)
        partial = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                          mask=split_mask[:, None], other=0.0, cache_modifier=".cg")
        out = tl.sum(partial * weights[:, None], axis=0)  # [HEAD_DIM_PAD]
        out_offs = seq.to(tl.int64) * stride_os + head * stride_oh + offs_d * stride_od
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits", "stride_bts"])
def _paged_attention_v2_kernel(
    out_ptr,
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] fp32, normalized per split
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2(sum exp2(scores)) per split
    counters_ptr,  # [>= num_seqs * num_kv_heads] int32, all 0 between launches
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale, num_splits,
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_bts,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PDL: tl.constexpr,
):
    signal_dependents(PDL)
    wait_for_inputs(PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, TILE_N)
    num_valid = tl.cdiv(seq_len, split_len)  # non-empty splits of this sequence (<= num_splits)
    start = split * split_len
    # A short sequence needs fewer splits: programs past its end do nothing (nor count).
    if start < seq_len:
        end = tl.minimum(start + split_len, seq_len)
        q, heads, mask = _load_query_group(
            query_ptr, seq, kv_head, stride_qs, stride_qh, stride_qd,
            GROUP_SIZE, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD,
        )
        acc, l_i, m_i = _attend_token_range(
            q, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bts,
            kv_head.to(tl.int64) * stride_ch, start, end, qk_scale,
            stride_cb, stride_ct, stride_cd,
            BLOCK_SIZE, TILE_N, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD,
        )
        # Partials are contiguous buffers we allocate, so their offsets are computed directly.
        rows = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits  # split 0 of each head
        row_mask = tl.arange(0, GROUP_PAD) < GROUP_SIZE
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        tl.store(partial_out_ptr + (rows + split)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                 acc / l_i[:, None], mask=mask)
        # log2 of this split's softmax denominator, in the same base-2 units as the scores.
        tl.store(partial_lse_ptr + rows + split, m_i + tl.log2(l_i), mask=row_mask)

        # The barrier orders every thread's stores before the atomic (one thread's); "acq_rel"
        # publishes them (release) and shows the last program the others' (acquire).
        tl.debug_barrier()
        counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
        arrived_before = tl.atomic_add(counter, 1, sem="acq_rel")  # returns the old value
        if arrived_before == num_valid - 1:  # every other split has written its partials
            _merge_splits(out_ptr, partial_out_ptr, partial_lse_ptr, seq, kv_head, num_splits, num_valid,
                          stride_os, stride_oh, stride_od,
                          NUM_HEADS, GROUP_SIZE, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD)
            # No one else touches the counter now: zero it for the next layer or graph replay.
            tl.atomic_xchg(counter, 0, sem="relaxed")


# ---- The Python side: validate, choose v1 or v2, launch. ----
@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter: parallelism is irrelevant, keep the one-pass kernel
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many pieces to cut each sequence's context into (1 = the one-pass v1 kernel).

    >>> choose_num_kv_splits(num_seqs=64, num_kv_heads=8, max_context_len=4096, num_sms=132)
    1
    >>> choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_context_len=4096, num_sms=132)
    64
    """
    programs = num_seqs * num_kv_heads
    if programs >= V1_MIN_PROGRAMS_PER_SM * num_sms:
        return 1
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs)
    most_useful = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return int(min(wanted, most_useful, MAX_KV_SPLITS))


# device -> the counter workspaces handed out so far, newest (largest) last. Old ones are kept:
# a captured CUDA graph holds their addresses, not a reference that would keep them alive.
_SPLIT_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
MIN_SPLIT_COUNTERS = 4096  # 16 KiB of int32: room for 512 sequences x 8 KV heads at once


def split_counters(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 workspace of >= `size` counters on `device`, one per (sequence, KV head),
    reused by every layer and step. A CUDA-graph capture's eager warm-up step
    (`CUDAGraphRunner.capture`) allocates it outside the graph."""
    workspaces = _SPLIT_COUNTERS.setdefault(device, [])
    if not workspaces or workspaces[-1].numel() < size:
        workspaces.append(torch.zeros(max(size, MIN_SPLIT_COUNTERS), dtype=torch.int32, device=device))
    return workspaces[-1]


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_kv_splits: int | None = None) -> torch.Tensor:
    """out [num_seqs, num_heads, head_dim] in query's dtype, by v1 or v2 (split-KV).

    num_kv_splits: None = `choose_num_kv_splits`; 1 = v1; > 1 = v2 with that many splits.
    """
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError("query must be [num_seqs, num_heads, head_dim] and key_cache "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim != cache_head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {cache_head_dim}")
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError("block_tables and seq_lens need one row per sequence of query")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    group_size = num_heads // num_kv_heads
    if num_seqs == 0:
        return torch.empty_like(query)
    if num_kv_splits is None:
        # The block table's width bounds every context length: a shape, so no device sync.
        max_context_len = block_tables.shape[1] * block_size
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_context_len, _num_sms(query.device))

    out = torch.empty_like(query)
    tile_tokens, num_warps, num_stages = V1_CONFIG if num_kv_splits == 1 else V2_CONFIG
    meta = dict(
        BLOCK_SIZE=block_size, TILE_N=tile_tokens,
        GROUP_SIZE=group_size, GROUP_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        num_warps=num_warps, num_stages=num_stages,
    )
    qk_scale = scale * LOG2E
    cache_strides = key_cache.stride()
    if num_kv_splits == 1:
        _paged_attention_v1_kernel[(num_kv_heads, num_seqs)](
            out, query, key_cache, value_cache, block_tables, seq_lens, qk_scale,
            *query.stride(), *out.stride(), *cache_strides, block_tables.stride(0), **meta,
            **pdl_options(query),
        )
        return out

    partial_out = torch.empty(num_seqs, num_heads, num_kv_splits, meta["HEAD_DIM_PAD"],
                              dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_kv_splits, dtype=torch.float32, device=query.device)
    counters = split_counters(query.device, num_seqs * num_kv_heads)
    _paged_attention_v2_kernel[(num_kv_heads, num_seqs, num_kv_splits)](
        out, partial_out, partial_lse, counters, query, key_cache, value_cache, block_tables, seq_lens,
        qk_scale, num_kv_splits, *query.stride(), *out.stride(), *cache_strides, block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
        **meta, **pdl_options(query),
    )
    return out
