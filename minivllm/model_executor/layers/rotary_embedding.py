"""Rotary position embedding, with Llama 3's long-context scaling (vLLM's
`vllm/model_executor/layers/rotary_embedding.py`).

The feature pair (x_i, x_{i+d/2}) of a token at position p turns by p * inv_freq[i],
inv_freq[i] = theta ** (-2i / d): Hugging Face's "NeoX" layout of pairs, two halves.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm.kernels.reference import rotate_pairs
from minivllm.model_executor.custom_op import CustomOp

_DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(hf_config: Any) -> dict:
    """A Hugging Face config's rope settings as one dict with `rope_type` and `rope_theta`,
    from `rope_parameters` (transformers >= 5) or `rope_theta` and `rope_scaling` (4.x)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", _DEFAULT_ROPE_THETA))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
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
    """Llama 3.1's scaling: features with wavelengths under original_context / high_freq_factor
    stay, those over original_context / low_freq_factor slow down by `factor`, those between
    blend."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original_context / low, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low) / (high - low)  # 0 at the slow end, 1 at the fast end
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_between = (wavelen >= original_context / high) & (wavelen <= original_context / low)
    return torch.where(in_between, blended, slowed)


class RotaryEmbedding(CustomOp):
    """Rotate queries and keys by their positions, gathering rows of a cos/sin table of every
    position up to `max_position`, computed once in fp32."""

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict, backend: str = "torch") -> None:
        super().__init__(backend)
        self.head_dim, self.max_position = head_dim, max_position
        self.rope_type = rope_parameters["rope_type"]
        inv_freq = compute_inv_freq(head_dim, rope_parameters)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of every pair's angle, then its sin; not a weight.
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; query [num_tokens, num_heads, head_dim]; key
        [num_tokens, num_kv_heads, head_dim]. Returns the rotated query and key."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # each [num_tokens, head_dim/2]
        cos = cos.unsqueeze(1).to(query.dtype)  # broadcast over heads
        sin = sin.unsqueeze(1).to(query.dtype)
        return rotate_pairs(query, cos, sin), rotate_pairs(key, cos, sin)

    def forward_triton(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel per tensor (`kernels/fused_ops.py`): forward_native's result in fp32,
        within one rounding step in bf16 (it rounds once per output, not per product)."""
        from minivllm.kernels import fused_ops  # imports triton: only when this backend is chosen

        if not fused_ops.rotary_supported(self.head_dim) or query.stride(-1) != 1 or key.stride(-1) != 1:
            return self.forward_native(positions, query, key)
        return fused_ops.rotary(query, positions, self.cos_sin_cache), fused_ops.rotary(key, positions, self.cos_sin_cache)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, rope_type={self.rope_type!r}"
