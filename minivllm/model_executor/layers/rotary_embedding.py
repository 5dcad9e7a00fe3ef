"""Rotary position embedding (RoPE, Su et al. 2021), with Llama 3's long-context scaling.

RoPE encodes position by rotating pairs of query/key features: the pair (x_i, x_{i+d/2}) of a
token at position p is turned by the angle p * inv_freq[i], where
inv_freq[i] = theta ** (-2i / d). The dot product of a rotated query (position m) and key
(position n) then depends only on m - n, so attention sees relative positions, and a key
rotated once when it is written to the KV cache never has to change again.

Pairs are (i, i + d/2), the "NeoX" layout Hugging Face's Llama code uses (its conversion
script permutes Meta's interleaved weights to match), so features split into two halves.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from minivllm.model_executor.custom_op import CustomOp

_DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(hf_config: Any) -> dict:
    """The rope settings of a Hugging Face config as one dict with `rope_type` and `rope_theta`.

    transformers >= 5 keeps them in `config.rope_parameters` (theta included); 4.x keeps
    `config.rope_theta` and an optional `config.rope_scaling` dict (whose type key was once
    "type"). Both layouts give the same dict here.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not params:  # transformers 4.x
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", _DEFAULT_ROPE_THETA))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("rope_theta", _DEFAULT_ROPE_THETA)
    return params


def compute_inv_freq(head_dim: int, rope_parameters: dict) -> torch.Tensor:
    """inv_freq [head_dim // 2] in fp32: the rotation speed of each feature pair."""
    rope_type = rope_parameters["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; choose one of {SUPPORTED_ROPE_TYPES}.")
    # Same expression as transformers, so fp32 results agree to the last bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_parameters["rope_theta"] ** exponents)
    if rope_type == "linear":  # position interpolation: every position divided by `factor`
        inv_freq = inv_freq / rope_parameters["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_parameters)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling for a longer context.

    Features that turn fast (wavelength shorter than original_context / high_freq_factor)
    carry local word order and stay as they are; slow ones (wavelength longer than
    original_context / low_freq_factor) would see angles never met in training, so they slow
    down by `factor`; those in between blend smoothly.
    """
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original_context / low, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low) / (high - low)  # 0 at the slow end, 1 at the fast end
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_between = (wavelen >= original_context / high) & (wavelen <= original_context / low)
    return torch.where(in_between, blended, slowed)


class RotaryEmbedding(CustomOp):
    """Rotate queries and keys by their positions.

    A cache of cos/sin for every position up to `max_position` is computed once (fp32), so
    a step only gathers rows by `positions`, whatever mix of prefills and decodes it holds.
    """

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict, backend: str = "torch") -> None:
        super().__init__(backend)
        self.head_dim, self.max_position = head_dim, max_position
        self.rope_type = rope_parameters["rope_type"]
        inv_freq = compute_inv_freq(head_dim, rope_parameters)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of every pair's angle, then its sin. Not saved with
        # the weights (persistent=False): it is derived from the config.
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; query [num_tokens, num_heads, head_dim]; key
        [num_tokens, num_kv_heads, head_dim]. Returns the rotated query and key."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # each [num_tokens, head_dim/2]
        cos = cos.unsqueeze(1).to(query.dtype)  # broadcast over heads
        sin = sin.unsqueeze(1).to(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def forward_triton(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel per tensor (`kernels/fused_ops.py`). fp32: forward_native's result; bf16:
        it rounds once per output where forward_native also rounds each product, so it may
        differ by one bf16 step (tests/model_executor/test_fused_ops.py). With a KV cache, a
        "triton" Llama-family attention skips this module: its one-kernel prologue
        (`fused_ops.qk_norm_rope_and_cache`) rotates q and k and writes the cache."""
        from minivllm.kernels import fused_ops  # imports triton: only when this backend is chosen

        if not fused_ops.rotary_supported(self.head_dim) or query.stride(-1) != 1 or key.stride(-1) != 1:
            return self.forward_native(positions, query, key)
        return fused_ops.rotary(query, positions, self.cos_sin_cache), fused_ops.rotary(key, positions, self.cos_sin_cache)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, rope_type={self.rope_type!r}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (x1, x2) = (x[..., i], x[..., i + d/2]) by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
