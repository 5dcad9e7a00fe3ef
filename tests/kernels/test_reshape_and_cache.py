"""The Triton reshape_and_cache against the reference: an exact copy, so exact equality."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import reference
from minivllm.kernels.reshape_and_cache import reshape_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 8), (3, 32, 32)])
def test_reshape_and_cache_matches_reference(paged_cache, dtype, num_kv_heads, head_dim, block_size):
    cache = paged_cache(8, block_size, num_kv_heads, head_dim, dtype)
    expected = cache.kv_cache.clone()
    num_tokens = 6
    # k and v as the model produces them: strided views into one fused qkv tensor.
    qkv = cache.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim, dtype=dtype)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    slots = torch.randperm(8 * block_size, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[2] = -1  # a padding token
    slots[4] = 8 * block_size - 1  # the very last slot of the cache
    slot_mapping = slots.to(DEVICE)
    reshape_and_cache(key, value, cache.key_cache, cache.value_cache, slot_mapping)
    reference.reshape_and_cache(key, value, expected[0], expected[1], slot_mapping)
    assert torch.equal(cache.kv_cache, expected)


def test_reshape_and_cache_rejects_mismatched_shapes(paged_cache):
    cache = paged_cache(4, 8, 2, 32, torch.float32)
    key = cache.randn(3, 2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, cache.key_cache, cache.value_cache,
                          torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="head"):
        reshape_and_cache(key[:, :1], key[:, :1], cache.key_cache, cache.value_cache,
                          torch.zeros(3, dtype=torch.int64, device=DEVICE))
