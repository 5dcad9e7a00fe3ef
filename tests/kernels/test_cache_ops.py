"""copy_blocks (Triton) and swap_blocks (async copies) against the references: exact equality."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import cache_ops, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(8, 2, 64), (32, 1, 128)])
def test_copy_blocks_copies_every_layer_like_the_reference(paged_cache, block_size, num_kv_heads, head_dim):
    layers = [paged_cache(6, block_size, num_kv_heads, head_dim, torch.float32, seed=s).kv_cache for s in range(3)]
    expected = [layer.clone() for layer in layers]
    mapping = torch.tensor([[0, 5], [2, 3], [2, 4]], device=DEVICE)  # one source, two forks
    cache_ops.copy_blocks(layers, mapping)
    reference.copy_blocks(expected, mapping)
    for layer, want in zip(layers, expected):
        assert torch.equal(layer, want)


def test_swap_blocks_round_trip(paged_cache):
    gpu_pool = paged_cache(6, 8, 2, 32, torch.float32).kv_cache
    cpu_pool = torch.randn(2, 4, 8, 2, 32, pin_memory=torch.cuda.is_available())
    expected = cpu_pool.clone()
    out_mapping = torch.tensor([[5, 0], [1, 3]])
    cache_ops.swap_blocks(gpu_pool, cpu_pool, out_mapping)  # swap out
    reference.swap_blocks(gpu_pool, expected, out_mapping)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the device -> pinned-host copies are asynchronous
    assert torch.equal(cpu_pool, expected)
    restored = gpu_pool.clone()
    restored[:, [2, 4]] = 0
    cache_ops.swap_blocks(cpu_pool, restored, torch.tensor([[0, 2], [3, 4]]))  # swap in elsewhere
    assert torch.equal(restored[:, 2], gpu_pool[:, 5]) and torch.equal(restored[:, 4], gpu_pool[:, 1])


def test_copy_blocks_rejects_a_bad_mapping(paged_cache):
    layer = paged_cache(4, 8, 2, 32, torch.float32).kv_cache
    with pytest.raises(ValueError, match="num_pairs, 2"):
        cache_ops.copy_blocks([layer], torch.tensor([0, 1], device=DEVICE))
