"""The specification in plain PyTorch: every attention, cache and sampling op that a Triton
kernel implements, with exactly that kernel's signature (`get_ops`, `kernels/sampling.py`).

No triton import: it runs anywhere (a Mac included), is the "torch" backend on a CPU, and is what
`tests/kernels/` checks every Triton kernel against. One KV-cache tensor per layer:

    kv_cache                                   [2, num_blocks, block_size, num_kv_heads, head_dim]
    key_cache, value_cache = kv_cache          [num_blocks, block_size, num_kv_heads, head_dim]

Token t of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`:
row `slot` of the cache viewed as `[num_blocks * block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1  # a slot_mapping entry of a padding token: nothing is written for it
_MASK64 = (1 << 64) - 1


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key, value `[num_tokens, num_kv_heads, head_dim]` into their slots of the paged
    cache, in place. slot_mapping: `[num_tokens]` int64, block number x block_size + offset."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[valid]
    # Viewing the cache as one long list of slots turns the write into a single scatter.
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(value_cache.dtype)


def qk_norm_rope_and_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                           k_norm_weight: torch.Tensor | None = None,
                           eps: float = 1e-6) -> torch.Tensor:
    """The spec of `fused_ops.qk_norm_rope_and_cache`: a decoder layer between its qkv projection
    and attention in the layers' own arithmetic (RMSNorm, RotaryEmbedding, reshape_and_cache), so
    fp32 results match them bit for bit. Returns the normed, rotated query; the normed, rotated
    key and the value go into the caches.

    query `[num_tokens, num_heads, head_dim]`; key, value `[num_tokens, num_kv_heads, head_dim]`;
    positions, slot_mapping `[num_tokens]` int64; cos_sin_cache `[max_position, head_dim]` (each
    pair's cos, then its sin); q/k_norm_weight `[head_dim]` (Qwen3's per-head RMSNorm; None: none).
    """
    if q_norm_weight is not None:
        query = rms_norm(query, q_norm_weight, eps)
        key = rms_norm(key, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # each [num_tokens, head_dim / 2]
    cos, sin = cos.unsqueeze(1).to(query.dtype), sin.unsqueeze(1).to(query.dtype)  # over heads
    query, key = rotate_pairs(query, cos, sin), rotate_pairs(key, cos, sin)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return query


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32, cast back before the weight: Hugging
    Face's order, so fp32 logits match bit for bit."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, NeoX layout: turn each pair (x[..., i], x[..., i + d/2]) by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` keys and values, read back out of the paged cache through
    its block_table `[max_blocks]`: two contiguous `[seq_len, num_kv_heads, head_dim]`."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    # [num_blocks, block_size, H, D] -> [num_blocks * block_size, H, D] -> first seq_len tokens
    keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, values


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               num_context: int) -> torch.Tensor:
    """Grouped-query attention in fp32 of query `[query_len, num_heads, D]` over keys, values
    `[seq_len, num_kv_heads, D]`. The queries are the last `query_len` positions: query i sees
    keys 0 .. num_context + i (all `num_context` cached ones, causal over the new ones)."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group_size = num_heads // num_kv_heads  # query heads that share one KV head
    k = keys.float().repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, D]
    v = values.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # [heads, query_len, seq_len]
    query_pos = num_context + torch.arange(query_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    visible = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_kv_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence, query `[num_seqs, num_heads, head_dim]`, over
    its seq_lens `[num_seqs]` int32 cached tokens (the new one included) through block_tables
    `[num_seqs, max_blocks]` int32. num_kv_splits tunes the Triton kernel, ignored here."""
    # A prefill of one new token per sequence: it sits at the last position and sees every key.
    query_start_loc = torch.arange(len(seq_lens) + 1, device=query.device)
    return paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                   seq_lens, scale)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context and themselves: query
    `[num_tokens, num_heads, head_dim]`, sequence i's at `query[query_start_loc[i]:
    query_start_loc[i + 1]]`; seq_lens `[num_seqs]` int32, context + new tokens, every key read
    from the cache (reshape_and_cache writes the new ones first)."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        keys, values = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        num_context = seq_len - (end - start)
        out[start:end] = _attention(query[start:end], keys, values, scale, num_context)
    return out


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy-on-write: whole blocks, keys and values, within each layer's `kv_cache`, in place.
    block_mapping: `[num_pairs, 2]` int64 rows of (src_block, dst_block) on the caches' device."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for kv_cache in kv_caches:
        kv_cache[:, dst] = kv_cache[:, src]


def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """Copy blocks of one layer between two pools, which may live on different devices (swap-out
    to the CPU, swap-in back). block_mapping: `[num_pairs, 2]` rows of (src_block, dst_block)."""
    for src_block, dst_block in block_mapping.cpu().tolist():
        dst_kv_cache[:, dst_block].copy_(src_kv_cache[:, src_block])


# --------------------------------------------------------------------------- sampling
def check_sample_tokens_args(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                             offsets: torch.Tensor) -> None:
    """ValueError unless the arguments fit `sample_tokens`' contract: shapes, dtypes and devices
    only (values are never read, so this never waits for the device)."""
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be 2-D with unit stride on the vocabulary, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}.")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}.")
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                  offsets=offsets)
    for name, value in params.items():
        if value.shape != logits.shape[:1]:
            raise ValueError(f"{name} must have shape ({logits.shape[0]},) (one per logits row), "
                             f"got {tuple(value.shape)}.")
        if value.device != logits.device:
            raise ValueError(f"{name} is on {value.device}, the logits on {logits.device}.")
        wants_float = name in ("temperature", "top_p", "min_p")
        if value.is_floating_point() != wants_float or value.is_complex():
            kind = "a float" if wants_float else "an integer"
            raise ValueError(f"{name} must be {kind} tensor, got {value.dtype}.")


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                  offsets: torch.Tensor, *, needs_truncation: bool | None = None,
                  num_candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, `[rows]` int64, and its logprob, `[rows]` fp32 (the spec of
    `sampling.sample_tokens`, whose hints needs_truncation and num_candidates are ignored here):
    logits `[rows, vocab]` float, unit stride on the vocabulary; temperature, top_p, min_p `[rows]`
    float (0 = greedy; 1.0, 0.0 = off); top_k `[rows]` int (<= 0 or >= vocab = off); seeds, offsets
    `[rows]` int64. z = logits / T (T = 1 for greedy rows), kept = `kept_mask(z, ...)`; greedy rows
    take the arg-max of z (the first among ties), the others that of kept z + `row_race_noise` (a draw
    from softmax over the kept set). logprob = z[token] - logsumexp(kept z). Triton's noise comes
    from Philox: the same distribution, not the same tokens (greedy tokens and logprobs agree).
    """
    check_sample_tokens_args(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, 1.0, temperature.float()).unsqueeze(1)
    kept = kept_mask(z, top_k, top_p, min_p)
    kept_z = z.masked_fill(~kept, -float("inf"))
    noise = torch.zeros_like(z, dtype=torch.float64)  # a greedy row draws none: its arg-max ignores it
    for row, (seed, offset, is_greedy) in enumerate(zip(seeds.tolist(), offsets.tolist(), greedy.tolist())):
        if not is_greedy:
            noise[row] = row_race_noise(seed, offset, z.shape[1], z.device)
    # E = 0 makes the noise +inf, and -inf + inf is NaN, which would win the arg-max: a token of
    # probability 0 (dropped, or -inf from the start) keeps score -inf whatever its noise.
    finite = kept_z > -float("inf")
    random_tokens = torch.where(finite, kept_z.double() + noise, -float("inf")).argmax(-1)
    tokens = torch.where(greedy, z.argmax(dim=-1), random_tokens)
    logprobs = z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(kept_z, dim=-1)
    return tokens, logprobs


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """New `[rows, vocab]` fp32 logits (the spec of `sampling.apply_penalties`). Repetition
    (CTRL's): a logit of a prompt or output token divided by the penalty if positive, else
    multiplied; frequency: minus penalty x the token's output count; presence: minus penalty if
    it is in the output. logits `[rows, vocab]` any float; prompt_mask, output_counts `[rows,
    vocab]` bool, fp32; repetition, frequency, presence `[rows]` fp32 (1.0, 0.0, 0.0 = off)."""
    logits = logits.float()
    in_output = output_counts > 0
    penalty = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(prompt_mask | in_output, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * in_output.to(logits.dtype)


def kept_mask(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> torch.Tensor:
    """`[rows, vocab]` bool: the tokens of z `[rows, vocab]` that survive top-k (ties at the k-th
    value kept), then top-p (the smallest most-likely set with mass >= p over the top-k
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
    """The noise `sample_tokens` adds to z (the spec of `sampling.race_noise`): `[rows,
    num_tokens]` fp32 for token ids 0..num_tokens - 1 of the rows' seeds, offsets `[rows]` int64."""
    noise = torch.empty(len(seeds), num_tokens, device=seeds.device)
    for row, (seed, offset) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        noise[row] = row_race_noise(seed, offset, num_tokens, seeds.device)
    return noise


def row_race_noise(seed: int, offset: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """`[vocab]` fp64 -log(E), E ~ Exp(1) per token, from a generator seeded by (seed, offset):
    arg-max(z + noise) is a draw from softmax(z) (the exponential race / Gumbel-max)."""
    generator = torch.Generator(device=device).manual_seed(mix_seed(seed, offset))
    uniform = torch.rand(vocab_size, generator=generator, device=device, dtype=torch.float64)
    # E = -log(1 - u) > 0, finite noise: u = 0 (probability 2^-53) is taken as 2^-64, about the
    # Triton kernel's smallest.
    return -torch.log(-torch.log1p(-uniform.clamp_(min=2.0**-64)))


def mix_seed(seed: int, offset: int) -> int:
    """A 64-bit generator seed from (seed, offset): the SplitMix64 finalizer of seed + golden
    ratio x (offset + 1), so that neighbouring seeds and offsets give unrelated streams."""
    x = (seed + 0x9E3779B97F4A7C15 * (offset + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
