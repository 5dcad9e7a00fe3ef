"""`fused_ops.qk_norm_rope_and_cache` (one kernel: Qwen3's q/k head norms, rotary, the cache
write) against its PyTorch spec `reference.qk_norm_rope_and_cache`, and that spec against the
unfused layers it replaces (RMSNorm, RotaryEmbedding, reshape_and_cache) bit for bit.

On the CPU the kernel runs in Triton's interpreter in fp32; on the GPU machine also in bf16 at
the Qwen3-0.6B layer shape (`-m gpu`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.kernels import fused_ops, reference
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


class Layer:
    """One attention layer's inputs: q, k, v as views of a qkv output, the layer's norms and
    rotary table, a random paged cache (random, so an unwritten or misplaced slot shows)."""

    def __init__(self, num_tokens, num_heads, num_kv_heads, head_dim, dtype, rope=ROPE,
                 num_blocks=8, block_size=4, max_position=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        self.q = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)  # strided views, no copies
        self.k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
        self.v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
        self.rotary = RotaryEmbedding(head_dim, max_position, rope).to(DEVICE)
        self.q_norm, self.k_norm = (RMSNorm(head_dim, eps=1e-6).to(DEVICE, dtype) for _ in range(2))
        for norm in (self.q_norm, self.k_norm):
            norm.weight.data = torch.randn(head_dim, generator=g).to(DEVICE, dtype)
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
        self.positions = torch.randint(max_position, (num_tokens,), generator=g).to(DEVICE)
        # Distinct slots, one token a padding token (-1) when there are several.
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
        if num_tokens > 1:
            slots[1] = reference.PAD_SLOT_ID
        self.slot_mapping = slots.to(DEVICE)

    def norm_weights(self, with_norm: bool) -> tuple:
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if with_norm else ()

    def run(self, fn, with_norm: bool):
        """fn's query and the cache it leaves (on a copy of the layer's cache)."""
        cache = self.kv_cache.clone()
        query = fn(self.q, self.k, self.v, cache[0], cache[1], self.slot_mapping, self.positions,
                   self.rotary.cos_sin_cache, *self.norm_weights(with_norm))
        return query, cache

    def unfused(self, with_norm: bool):
        """What LlamaAttention.forward_native does: norms, rotary, then reshape_and_cache."""
        q, k = (self.q_norm(self.q), self.k_norm(self.k)) if with_norm else (self.q, self.k)
        q, k = self.rotary(self.positions, q, k)
        cache = self.kv_cache.clone()
        reference.reshape_and_cache(k, self.v, cache[0], cache[1], self.slot_mapping)
        return q, cache


@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3-qk-norm", "llama-no-norm"])
@pytest.mark.parametrize("rope", [ROPE, LLAMA3_ROPE], ids=["rope", "llama3-rope"])
def test_reference_is_the_unfused_layers_bit_for_bit(with_norm, rope):
    layer = Layer(6, 4, 2, 16, torch.float32, rope=rope)
    with torch.no_grad():
        query, cache = layer.run(reference.qk_norm_rope_and_cache, with_norm)
        expected_query, expected_cache = layer.unfused(with_norm)
    assert torch.equal(query, expected_query)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3-qk-norm", "llama-no-norm"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    pytest.param(4, 2, 16, 4, id="gqa2-d16-bs4"),
    pytest.param(3, 3, 32, 8, id="mha-d32-bs8"),
    pytest.param(8, 1, 64, 16, id="gqa8-d64-bs16"),
])
def test_kernel_matches_the_reference_fp32(with_norm, num_heads, num_kv_heads, head_dim, block_size):
    """Rotary and the cache write are exact in the interpreter; on the GPU Triton contracts
    rotary's multiply and add into one FMA (one rounding fewer than torch), and with the norm
    its sum of squares may be added in another order than torch's: fp32 roundings, nothing
    more. Values are copied exactly, and every slot not in slot_mapping (the padding token's
    included) keeps its old content."""
    layer = Layer(5, num_heads, num_kv_heads, head_dim, torch.float32, block_size=block_size)
    with torch.no_grad():
        query, cache = layer.run(fused_ops.qk_norm_rope_and_cache, with_norm)
        expected_query, expected_cache = layer.run(reference.qk_norm_rope_and_cache, with_norm)
    if with_norm or DEVICE == "cuda":
        torch.testing.assert_close(query, expected_query, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(query, expected_query) and torch.equal(cache, expected_cache)
    assert torch.equal(cache[1], expected_cache[1])  # values: a plain copy
    written = layer.slot_mapping[layer.slot_mapping >= 0]
    untouched = torch.ones(cache[0].numel() // (num_kv_heads * head_dim), dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    for c in (0, 1):
        slots = cache[c].reshape(-1, num_kv_heads, head_dim)
        assert torch.equal(slots[untouched], layer.kv_cache[c].reshape(-1, num_kv_heads, head_dim)[untouched])


@settings(max_examples=15, deadline=None)
@given(slots=st.lists(st.integers(-1, 31), min_size=1, max_size=6, unique=True),
       positions=st.lists(st.integers(0, 511), min_size=6, max_size=6))
def test_each_token_lands_in_its_own_slot(slots, positions):
    """Property: whatever the slots (-1 = padding) and positions, the cache row of each slot
    holds exactly its token's rotated key and value, and no other row changes."""
    layer = Layer(len(slots), 2, 2, 16, torch.float32)
    layer.slot_mapping = torch.tensor(slots, device=DEVICE)
    layer.positions = torch.tensor(positions[: len(slots)], device=DEVICE)
    with torch.no_grad():
        _, cache = layer.run(fused_ops.qk_norm_rope_and_cache, with_norm=False)
        _, expected_cache = layer.unfused(with_norm=False)
    if DEVICE == "cuda":  # rotary's FMA on the GPU; a misplaced row would be far off
        torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(cache, expected_cache)


def test_an_empty_batch_writes_nothing():
    layer = Layer(0, 4, 2, 16, torch.float32)
    query, cache = layer.run(fused_ops.qk_norm_rope_and_cache, with_norm=True)
    assert query.shape == (0, 4, 16) and torch.equal(cache, layer.kv_cache)


def test_bad_arguments_raise():
    layer = Layer(2, 4, 2, 16, torch.float32)
    cache = layer.kv_cache
    with pytest.raises(ValueError, match="both"):
        fused_ops.qk_norm_rope_and_cache(layer.q, layer.k, layer.v, cache[0], cache[1], layer.slot_mapping,
                                         layer.positions, layer.rotary.cos_sin_cache, layer.q_norm.weight, None)
    with pytest.raises(ValueError, match="head_dim"):  # 12 is not a power of two
        q = torch.zeros(2, 4, 12)
        kv = torch.zeros(2, 2, 12)
        fused_ops.qk_norm_rope_and_cache(q, kv, kv, torch.zeros(4, 4, 2, 12), torch.zeros(4, 4, 2, 12),
                                         layer.slot_mapping, layer.positions, torch.zeros(64, 12))


def _assert_within_bf16_rounding(actual, expected, rotated_from):
    """|actual - expected| <= 6u (|x1| + |x2|) + 2u |expected| per element, u = 2^-8 (bf16's unit
    roundoff), x = the head before rotary: the norm's two roundings (before and after the
    weight) may each go the other way (its sum of squares is added in another order), then
    each product's and the sum's rounding. A wrong angle, pair or head is off by O(|x|)."""
    u = 2.0**-8
    half = rotated_from.shape[-1] // 2
    pair = rotated_from[..., :half].float().abs() + rotated_from[..., half:].float().abs()
    bound = 6 * u * torch.cat([pair, pair], dim=-1) + 2 * u * expected.float().abs()
    err = (actual.float() - expected.float()).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3-qk-norm", "llama-no-norm"])
def test_kernel_matches_the_reference_bf16_qwen3_shape(with_norm):
    """Qwen3-0.6B's layer (16 q heads, 8 KV heads, head_dim 128, block 16) in bf16, 256 tokens
    at positions up to 4096. The compiled kernel may keep rotary's products in fp32 where
    PyTorch rounds them to bf16 (see fused_ops' docstring), and the norm's sum may be added in
    another order: differences within bf16 rounding; values are copied exactly, other slots
    untouched."""
    layer = Layer(256, 16, 8, 128, torch.bfloat16, num_blocks=64, block_size=16, max_position=4096, seed=3)
    with torch.no_grad():
        query, cache = layer.run(fused_ops.qk_norm_rope_and_cache, with_norm)
        expected_query, expected_cache = layer.run(reference.qk_norm_rope_and_cache, with_norm)
        q_in, k_in = layer.q, layer.k
        if with_norm:
            q_in, k_in = layer.q_norm(q_in), layer.k_norm(k_in)
    _assert_within_bf16_rounding(query, expected_query, q_in)
    written = layer.slot_mapping >= 0
    slots = layer.slot_mapping[written]
    key_rows = cache[0].reshape(-1, 8, 128)
    _assert_within_bf16_rounding(key_rows[slots], expected_cache[0].reshape(-1, 8, 128)[slots], k_in[written])
    assert torch.equal(cache[1], expected_cache[1])
    untouched = torch.ones(key_rows.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(key_rows[untouched], layer.kv_cache[0].reshape(-1, 8, 128)[untouched])
