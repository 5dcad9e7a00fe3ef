"""PyTorch references of the five PagedAttention ops (and the greedy pick): the spec every Triton
kernel must match.

Plain, readable PyTorch (no triton import), so this module runs anywhere, macOS included, and
is the `"torch"` attention backend on CPU. Each function has exactly the signature of its
Triton twin in `minivllm.kernels` (see `get_ops`).

The KV cache layout, shared by every op (one tensor per layer):

    kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]
    key_cache  = kv_cache[0]   [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = kv_cache[1]  [num_blocks, block_size, num_kv_heads, head_dim]

Token t of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`,
i.e. row `slot` of the cache viewed as `[num_blocks * block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

# slot_mapping entries equal to this are padding tokens: nothing is written for them.
PAD_SLOT_ID = -1


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's key and value into its slot of the paged cache, in place.

    key, value:     [num_tokens, num_kv_heads, head_dim]
    key_cache,
    value_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:   [num_tokens] int64, slot = block_number * block_size + offset; -1 = skip.
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[valid]
    # Viewing the cache as one long list of slots turns the write into a single scatter.
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(value_cache.dtype)


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one sequence's first `seq_len` keys and values back out of the paged cache.

    block_table: [max_blocks] physical block numbers of this sequence (only the first
    ceil(seq_len / block_size) are used). Returns two contiguous `[seq_len, num_kv_heads, head_dim]`.
    """
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    # [num_blocks, block_size, H, D] -> [num_blocks * block_size, H, D] -> first seq_len tokens
    keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, values


def _attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    num_context: int,
) -> torch.Tensor:
    """Grouped-query attention of `query_len` new tokens over `seq_len` keys, in fp32.

    query [query_len, num_heads, D]; keys/values [seq_len, num_kv_heads, D]. The new tokens are
    the last `query_len` positions, so query i may see keys 0 .. num_context + i (causal over
    the new tokens, full over the `num_context` cached ones).
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group_size = num_heads // num_kv_heads  # query heads that share one KV head
    k = keys.float().repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, D]
    v = values.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # [num_heads, query_len, seq_len]
    query_pos = num_context + torch.arange(query_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    visible = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over all of that sequence's cached keys.

    query:          [num_seqs, num_heads, head_dim]
    key_cache,
    value_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:   [num_seqs, max_blocks] int32
    seq_lens:       [num_seqs] int32, number of cached tokens (the new one included)
    num_kv_splits:  ignored here (a tuning knob of the Triton kernel); kept for the same signature.
    Returns out:    [num_seqs, num_heads, head_dim], dtype of query.
    """
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        keys, values = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        # One query token that sits at the last position: it sees every key.
        out[i] = _attention(query[i : i + 1], keys, values, scale, num_context=seq_len - 1)[0]
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its whole cached context plus themselves.

    query:            [num_tokens, num_heads, head_dim], the sequences' new tokens back to back
    query_start_loc:  [num_seqs + 1] int32, sequence i's tokens are query[start[i]:start[i+1]]
    seq_lens:         [num_seqs] int32, context (already cached) + new tokens
    Every key and value is read from the paged cache, so reshape_and_cache must have written
    the new tokens first. Query i of a sequence with context c sees keys 0 .. c + i.
    max_query_len:    ignored here (sizes the Triton kernel's grid); kept for the same signature.
    Returns out:      [num_tokens, num_heads, head_dim], dtype of query.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        keys, values = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        num_context = seq_len - (end - start)
        out[start:end] = _attention(query[start:end], keys, values, scale, num_context)
    return out


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy-on-write: copy whole blocks within each layer's cache, keys and values, in place.

    kv_caches:      one `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer
    block_mapping:  [num_pairs, 2] int64 rows of (src_block, dst_block), same device as the caches
    """
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for kv_cache in kv_caches:
        kv_cache[:, dst] = kv_cache[:, src]


def swap_blocks(
    src_kv_cache: torch.Tensor,
    dst_kv_cache: torch.Tensor,
    block_mapping: torch.Tensor,
) -> None:
    """Copy blocks of one layer between two pools (GPU -> CPU swap-out, CPU -> GPU swap-in).

    src_kv_cache, dst_kv_cache: [2, num_blocks_*, block_size, num_kv_heads, head_dim], may live
    on different devices. block_mapping: [num_pairs, 2] rows of (src_block, dst_block).
    """
    mapping = block_mapping.cpu().tolist()
    for src_block, dst_block in mapping:
        dst_kv_cache[:, dst_block].copy_(src_kv_cache[:, src_block])


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's arg-max `[rows]` int64 and its logprob `[rows]` fp32: logit - logsumexp(row),
    in fp32 whatever the logits' dtype (the spec of `sampling.greedy_sample`)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, chosen - torch.logsumexp(logits, dim=-1)
