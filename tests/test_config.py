"""Config dataclasses: defaults, derived values and validation (vLLM v0's rules)."""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A config-only Llama checkpoint folder (no weights needed to read shapes)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=256, vocab_size=100).save_pretrained(path)
    return str(path)


# --------------------------------------------------------------------- model
def test_model_config_reads_shapes_from_the_hf_config(tiny_llama_dir):
    config = ModelConfig(tiny_llama_dir)
    assert config.tokenizer == tiny_llama_dir and config.max_model_len == 256
    assert (config.get_num_layers(), config.get_num_kv_heads(), config.get_head_size()) == (3, 2, 8)


def test_model_config_validates_dtype_and_max_model_len(tiny_llama_dir):
    assert ModelConfig(tiny_llama_dir, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len"):
        ModelConfig(tiny_llama_dir, max_model_len=257)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(tiny_llama_dir, dtype="float8")


def test_model_config_kv_heads_default_to_attention_heads(tiny_llama_dir):
    from transformers import LlamaConfig

    hf_config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    hf_config.num_key_value_heads = None
    config = ModelConfig(tiny_llama_dir, hf_config=hf_config)
    assert config.get_num_kv_heads() == 4 and config.get_head_size() == 8


# --------------------------------------------------------------------- cache
def test_cache_config_defaults_and_swap_bytes():
    config = CacheConfig()
    assert (config.block_size, config.gpu_memory_utilization, config.enable_prefix_caching) == (16, 0.9, False)
    assert CacheConfig(swap_space=0.5).swap_space_bytes == 1 << 29


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(block_size=12), dict(gpu_memory_utilization=0.0),
                                    dict(gpu_memory_utilization=1.5), dict(swap_space=-1),
                                    dict(num_gpu_blocks_override=0)])
def test_cache_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        CacheConfig(**kwargs)


# ----------------------------------------------------------------- scheduler
def test_scheduler_config_token_budget_defaults():
    assert SchedulerConfig().max_num_batched_tokens == 2048
    assert SchedulerConfig(max_model_len=4096).max_num_batched_tokens == 4096  # a whole prompt fits
    assert SchedulerConfig(enable_chunked_prefill=True, max_num_seqs=64).max_num_batched_tokens == 512


@pytest.mark.parametrize("kwargs", [
    dict(max_num_seqs=0), dict(max_model_len=0), dict(max_num_batched_tokens=1024, max_model_len=2048),
    dict(max_num_batched_tokens=100, max_num_seqs=256, enable_chunked_prefill=True),
    dict(preemption_mode="evict"), dict(policy="lifo")])
def test_scheduler_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_chunked_prefill_allows_a_budget_below_max_model_len():
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=2048,
                             enable_chunked_prefill=True)
    assert config.max_num_batched_tokens == 256


# ------------------------------------------------------------ parallel/device
def test_parallel_config_is_single_device():
    assert ParallelConfig().world_size == 1
    with pytest.raises(ValueError):
        ParallelConfig(tensor_parallel_size=2)


def test_device_config():
    import torch

    assert DeviceConfig().device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert DeviceConfig("cpu").device_type == "cpu" and DeviceConfig("cuda:1").device_type == "cuda"
    with pytest.raises(ValueError):
        DeviceConfig("tpu")
