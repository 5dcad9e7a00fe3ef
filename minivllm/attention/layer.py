"""The attention layer (vLLM v0's `vllm/attention/layer.py`): write the new keys and values
into the paged cache, then attend over it; the model above it knows nothing of blocks."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.metadata import AttentionMetadata
from minivllm.kernels import get_ops


class Attention(nn.Module):
    """Grouped-query attention over a paged KV cache: each of the num_kv_heads KV heads serves
    num_heads // num_kv_heads query heads. scale: usually head_dim ** -0.5."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 backend: str = "torch") -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend, self.ops = backend, get_ops(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim],
        kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] -> [num_tokens, num_heads, head_dim].

        k and v None: a fused kernel (`fused_ops.qk_norm_rope_and_cache`) already wrote them;
        the model still calls the module, so hooks on it (a KV connector's) run on every path.
        An empty kv_cache (the profile run): causal attention within each sequence.
        """
        if kv_cache.numel() == 0:
            return self._forward_without_cache(q, k, v, attn_metadata)
        if k is not None:
            # Write first: the kernels read every key, the new ones included, from the cache.
            self.ops.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], attn_metadata.slot_mapping)
        return self.forward_over_cache(q, kv_cache, attn_metadata)

    def forward_over_cache(self, q: torch.Tensor, kv_cache: torch.Tensor,
                           attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of q `[num_tokens, num_heads, head_dim]` over a cache that already holds
        this step's keys and values."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        prefill, decode = attn_metadata.prefill_metadata, attn_metadata.decode_metadata
        num_prefill_tokens = attn_metadata.num_prefill_tokens
        outputs = []
        if prefill is not None:  # causal over the new tokens, full over cached context
            outputs.append(self.ops.paged_prefill_attention(
                q[:num_prefill_tokens], key_cache, value_cache, prefill.block_tables,
                prefill.query_start_loc, prefill.seq_lens, self.scale))
        if decode is not None:  # one query token per sequence
            outputs.append(self.ops.paged_attention_decode(
                q[num_prefill_tokens:], key_cache, value_cache, decode.block_tables,
                decode.seq_lens, self.scale))
        if not outputs:  # an empty batch
            return torch.empty_like(q)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # no copy for one kind

    def _forward_without_cache(self, q, k, v, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Causal attention of each sequence's tokens over themselves (no cached context): one
        SDPA call per run of consecutive sequences of one length (the profile run is one run)."""
        out, end = torch.empty_like(q), 0
        lengths = attn_metadata.query_start_loc.diff().tolist()  # a host sync: fine in a profiling run
        for length, run in itertools.groupby(lengths):
            start, end = end, end + length * len(list(run))
            if length:  # SDPA wants [seqs, heads, tokens, head_dim]; enable_gqa shares each KV head
                qs, ks, vs = (t[start:end].unflatten(0, (-1, length)).transpose(1, 2) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
                out[start:end] = o.transpose(1, 2).flatten(0, 1)
        return out

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, scale={self.scale:.4g}, backend={self.backend!r}")
