"""CacheEngine: the block size formula against real tensors, and block moves."""

import pytest
import torch

from minivllm.config import CacheConfig, ModelConfig
from minivllm.worker.cache_engine import CacheEngine


def make_cache_engine(llama_dir, num_gpu_blocks=6, num_cpu_blocks=4, block_size=4):
    model_config = ModelConfig(model=llama_dir[0])
    cache_config = CacheConfig(block_size=block_size)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
    return CacheEngine(cache_config, model_config, "cpu", torch.float32), model_config


def test_the_swap_pool_is_allocated_at_its_first_use(llama_dir):
    """A pool far larger than this machine's memory: building the engine allocates none of it
    (most runs never swap); the first use of the pool does, and fails, as it must."""
    engine, _ = make_cache_engine(llama_dir, num_cpu_blocks=10**12)
    assert len(engine.gpu_cache) == llama_dir[1].config.num_hidden_layers
    with pytest.raises(RuntimeError):
        engine.cpu_cache  # noqa: B018


def test_the_swap_pool_is_one_buffer_reused_by_every_swap(llama_dir):
    engine, _ = make_cache_engine(llama_dir)
    first = engine.cpu_cache
    assert engine.cpu_cache is first and first[0].untyped_storage().data_ptr() == first[-1].untyped_storage().data_ptr()


def test_layout_and_block_bytes_match_the_allocated_tensors(llama_dir):
    engine, model_config = make_cache_engine(llama_dir)
    hf = llama_dir[1].config
    head_dim = hf.hidden_size // hf.num_attention_heads
    assert len(engine.gpu_cache) == hf.num_hidden_layers
    assert engine.gpu_cache[0].shape == (2, 6, 4, hf.num_key_value_heads, head_dim)
    assert engine.cpu_cache[0].shape == (2, 4, 4, hf.num_key_value_heads, head_dim)
    measured = sum(t.nbytes for t in engine.gpu_cache) // 6
    # keys and values x layers x tokens per block x KV heads x head size x 4 bytes (fp32)
    by_hand = 2 * hf.num_hidden_layers * 4 * hf.num_key_value_heads * head_dim * 4
    assert CacheEngine.get_cache_block_size(4, model_config, torch.float32) == measured == by_hand
    assert CacheEngine.get_cache_block_size(4, model_config, torch.bfloat16) == by_hand // 2


def test_the_swap_pool_is_one_buffer_with_a_view_per_layer(llama_dir):
    """One host allocation: torch's pinned allocator rounds each allocation up to a power of two."""
    engine, _ = make_cache_engine(llama_dir)
    layers = engine.cpu_cache
    assert len({layer.untyped_storage().data_ptr() for layer in layers}) == 1
    assert all(layer.is_contiguous() for layer in layers)
    assert [b.data_ptr() - a.data_ptr() for a, b in zip(layers, layers[1:])] == [layers[0].nbytes] * (len(layers) - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_a_gpu_engines_swap_pool_is_pinned_and_swaps_by_dma(llama_dir):
    model_config = ModelConfig(model=llama_dir[0])
    cache_config = CacheConfig(block_size=4)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = 6, 4
    engine = CacheEngine(cache_config, model_config, "cuda", torch.float16)
    assert all(layer.is_pinned() for layer in engine.cpu_cache)
    fill_block(engine.gpu_cache, 5, 2.0)
    engine.swap_out(torch.tensor([[5, 3]]))
    torch.cuda.synchronize()
    assert all(torch.all(layer[:, 3] == 2.0) for layer in engine.cpu_cache)


def fill_block(caches, block, value):
    for layer in caches:
        layer[:, block] = value


def test_swap_out_then_in_restores_the_blocks(llama_dir):
    engine, _ = make_cache_engine(llama_dir)
    fill_block(engine.gpu_cache, 2, 7.0)
    fill_block(engine.gpu_cache, 5, -3.0)
    engine.swap_out(torch.tensor([[2, 0], [5, 3]]))
    for layer in engine.cpu_cache:
        assert torch.all(layer[:, 0] == 7.0) and torch.all(layer[:, 3] == -3.0)
    fill_block(engine.gpu_cache, 2, 0.0)
    engine.swap_in(torch.tensor([[0, 1], [3, 4]]))
    for layer in engine.gpu_cache:
        assert torch.all(layer[:, 1] == 7.0) and torch.all(layer[:, 4] == -3.0)


def test_copy_duplicates_keys_and_values_in_every_layer(llama_dir):
    engine, _ = make_cache_engine(llama_dir)
    for layer in engine.gpu_cache:
        layer[0, 1], layer[1, 1] = 1.5, 2.5  # block 1: keys 1.5, values 2.5
    engine.copy(torch.tensor([[1, 3]]))
    for layer in engine.gpu_cache:
        assert torch.all(layer[0, 3] == 1.5) and torch.all(layer[1, 3] == 2.5)
        assert torch.all(layer[:, 0] == 0)
