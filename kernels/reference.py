"""PyTorch references of the PagedAttention ops and of sampling: the spec every Triton kernel
must match.

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


def qk_norm_rope_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The spec of `fused_ops.qk_norm_rope_and_cache`: what a decoder layer does between its
    qkv projection and attention, step by step, with the layers' exact arithmetic (RMSNorm,
    RotaryEmbedding, then reshape_and_cache), so fp32 results match them bit for bit.

    query [num_tokens, num_heads, head_dim]; key, value [num_tokens, num_kv_heads, head_dim];
    positions, slot_mapping [num_tokens] int64 (slot -1 = write nothing); cos_sin_cache
    [max_position, head_dim] (cos of each pair's angle, then its sin); q/k_norm_weight
    [head_dim] for Qwen3's per-head RMSNorm, None (both) to skip it.
    Returns the normed, rotated query [num_tokens, num_heads, head_dim]; the normed, rotated
    key and the value are written into the caches, in place.
    """
    if q_norm_weight is not None:
        query, key = _head_rms_norm(query, q_norm_weight, eps), _head_rms_norm(key, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # each [num_tokens, head_dim / 2]
    cos, sin = cos.unsqueeze(1).to(query.dtype), sin.unsqueeze(1).to(query.dtype)  # over heads
    query, key = _rotate_pairs(query, cos, sin), _rotate_pairs(key, cos, sin)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return query


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32, cast back before the weight (HF's order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, NeoX layout: turn each pair (x[..., i], x[..., i + d/2]) by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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


# --------------------------------------------------------------------------- sampling
_MASK64 = (1 << 64) - 1


def check_sample_tokens_args(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                             offsets: torch.Tensor) -> None:
    """ValueError with the reason unless the arguments fit `sample_tokens`' contract (shapes,
    dtypes and devices only: values are never read, so this never syncs with the device)."""
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be 2-D with unit stride on the vocabulary, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}.")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}.")
    rows = logits.shape[0]
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets)
    for name, value in params.items():
        if value.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},) (one per logits row), got {tuple(value.shape)}.")
        if value.device != logits.device:
            raise ValueError(f"{name} is on {value.device}, the logits on {logits.device}.")
        wants_float = name in ("temperature", "top_p", "min_p")
        if value.is_floating_point() != wants_float or value.is_complex():
            raise ValueError(f"{name} must be {'a float' if wants_float else 'an integer'} tensor, got {value.dtype}.")


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
                  needs_truncation: bool | None = None,
                  num_candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob: the spec of `sampling.sample_tokens` (same contract).

    z = logits / T (T = 1 where temperature is 0: greedy); kept = `kept_mask(z, ...)`. Greedy
    rows take the arg-max of z (first index among ties); the others the arg-max of kept z +
    noise, noise = -log(E), E ~ Exp(1) a function of (seed, offset, token id) alone (the
    exponential race: a draw from softmax(z) over the kept set, whatever the row's batch).
    logprob = z[token] - logsumexp(z over the kept set). The noise here comes from a torch
    generator seeded by (seed, offset), the Triton kernel's from Philox: the same distribution,
    not the same tokens; greedy tokens and logprobs agree.

    Args:
        logits: `[rows, vocab]` float, unit stride on the vocabulary.
        temperature, top_p, min_p: `[rows]` float (0 = greedy; 1.0 = off; 0.0 = off).
        top_k: `[rows]` int (<= 0 or >= vocab = off).  seeds, offsets: `[rows]` int64.
        needs_truncation, num_candidates: speed hints of the Triton version; ignored here.
    Returns:
        tokens `[rows]` int64 and logprobs `[rows]` fp32, on the logits' device.
    """
    check_sample_tokens_args(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, 1.0, temperature.float()).unsqueeze(1)
    kept = kept_mask(z, top_k, top_p, min_p)
    kept_z = z.masked_fill(~kept, -float("inf"))
    noise = torch.stack([_race_noise(int(s), int(o), z.shape[1], z.device)
                         for s, o in zip(seeds.tolist(), offsets.tolist())]) if len(z) else z.double()
    # E = 0 makes the noise +inf, and -inf + inf is NaN, which would win the arg-max: a token of
    # probability 0 (dropped, or -inf from the start) keeps score -inf whatever its noise.
    random_tokens = torch.where(kept_z > -float("inf"), kept_z.double() + noise, -float("inf")).argmax(dim=-1)
    tokens = torch.where(greedy, z.argmax(dim=-1), random_tokens)
    logprobs = z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(kept_z, dim=-1)
    return tokens, logprobs


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties from token statistics: the spec of
    `sampling.apply_penalties` (same contract).

    repetition (CTRL, transformers): a token seen in the prompt or the output has its logit
    divided by the penalty when positive, multiplied when negative. frequency: minus penalty x
    its count in the output. presence: minus penalty once if it is in the output (OpenAI's).

    Args:
        logits: `[rows, vocab]` float (any float dtype).
        prompt_mask: `[rows, vocab]` bool, the tokens of each row's prompt.
        output_counts: `[rows, vocab]` fp32, how often each token is in each row's output.
        repetition, frequency, presence: `[rows]` fp32 (1.0, 0.0, 0.0 = off).
    Returns:
        `[rows, vocab]` fp32 logits, a new tensor.
    """
    logits = logits.float()
    in_output = output_counts > 0
    penalty = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(prompt_mask | in_output, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * in_output.to(logits.dtype)


def kept_mask(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`[rows, vocab]` bool: the tokens of z `[rows, vocab]` that survive top-k (ties at the
    k-th value kept), then top-p (the smallest most-likely set with mass >= p over the top-k
    survivors; the most likely token always kept), then min-p (prob >= min_p x max prob)."""
    vocab_size = z.shape[1]
    values, order = z.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k).long()
    kth_value = values.gather(1, (k - 1).unsqueeze(1))
    in_top_k = values >= kth_value
    probs = values.masked_fill(~in_top_k, -float("inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # of the more likely survivors
    in_top_p = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    in_top_p[:, 0] = True
    # prob / max prob = exp(z - z_max), whatever the normalizer.
    in_min_p = torch.exp(values - values[:, :1]) >= min_p.unsqueeze(1)
    sorted_kept = in_top_k & in_top_p & in_min_p
    return torch.empty_like(sorted_kept).scatter_(1, order, sorted_kept)


def race_noise(seeds: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The noise `sample_tokens` adds to z: `[rows, num_tokens]` fp32 -log(E) of token ids
    0..num_tokens - 1 of rows with `seeds`, `offsets` `[rows]` int64. The spec of
    `sampling.race_noise` (same contract, Philox noise)."""
    noise = torch.empty(len(seeds), num_tokens, device=seeds.device)
    for row, (seed, offset) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        noise[row] = _race_noise(seed, offset, num_tokens, seeds.device)
    return noise


def _race_noise(seed: int, offset: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """`[vocab]` fp64 -log(E), E ~ Exp(1) per token, from a generator seeded by (seed, offset):
    arg-max(z + noise) is a draw from softmax(z) (the exponential race / Gumbel-max)."""
    generator = torch.Generator(device=device).manual_seed(_mix_seed(seed, offset))
    uniform = torch.rand(vocab_size, generator=generator, device=device, dtype=torch.float64)
    # E = -log(1 - u) > 0, finite noise: u = 0 (probability 2^-53) is taken as 2^-64, about the
    # Triton kernel's smallest.
    return -torch.log(-torch.log1p(-uniform.clamp_(min=2.0**-64)))


def _mix_seed(seed: int, offset: int) -> int:
    """A 64-bit generator seed from (seed, offset): the SplitMix64 finalizer of seed + golden
    ratio x (offset + 1), so that neighbouring seeds and offsets give unrelated streams."""
    x = (seed + 0x9E3779B97F4A7C15 * (offset + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
