"""Config dataclasses: defaults, derived values and validation (vLLM v0's rules)."""

from __future__ import annotations

import pytest

from minivllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)


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


READ_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "hidden_act", "vocab_size", "max_position_embeddings",
               "tie_word_embeddings", "architectures")


def qwen3_dir(tmp_path, leave_out: str | None = None) -> str:
    """A config-only Qwen3 folder, saved by transformers; `leave_out` deletes one field of its
    config.json, as a hand-written one may. Qwen3's head_dim (128 by default) is not
    hidden_size / num_attention_heads (8), so a missed class default shows."""
    import json

    from transformers import Qwen3Config

    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=512, vocab_size=100,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    config_json = tmp_path / "config.json"
    fields = json.loads(config_json.read_text())
    fields.pop(leave_out, None)
    config_json.write_text(json.dumps(fields))
    return str(tmp_path)


def test_a_complete_config_json_is_read_without_the_model_types_class(tmp_path, caplog):
    from transformers import AutoConfig

    path = qwen3_dir(tmp_path)
    with caplog.at_level("INFO", logger="minivllm.config"):
        config = ModelConfig(path)
    assert "model config: qwen3 from config.json in" in caplog.text
    assert type(config.hf_config) is not type(AutoConfig.from_pretrained(path))
    expected = AutoConfig.from_pretrained(path)
    for field in READ_FIELDS + ("head_dim",):
        assert getattr(config.hf_config, field) == getattr(expected, field), field
    assert (config.get_head_size(), config.max_model_len) == (128, 512)


@pytest.mark.parametrize("left_out", ["head_dim", "max_position_embeddings", "tie_word_embeddings"])
def test_a_config_json_that_leaves_a_field_to_its_class_goes_through_autoconfig(tmp_path, caplog, left_out):
    from transformers import AutoConfig, Qwen3Config

    with caplog.at_level("INFO", logger="minivllm.config"):
        config = ModelConfig(qwen3_dir(tmp_path, leave_out=left_out))
    assert "from transformers' AutoConfig" in caplog.text and f"leaves out {left_out}" in caplog.text
    assert isinstance(config.hf_config, Qwen3Config)
    assert getattr(config.hf_config, left_out) == getattr(Qwen3Config(), left_out)  # the class default
    assert type(AutoConfig.from_pretrained(tmp_path)) is Qwen3Config


def test_the_tokenizer_is_the_same_with_and_without_the_models_config():
    from transformers import AutoTokenizer

    config = ModelConfig()  # the bundled model
    ours, theirs = config.load_tokenizer(), AutoTokenizer.from_pretrained(config.tokenizer)
    assert type(ours) is type(theirs) and ours.eos_token_id == theirs.eos_token_id
    text = "To be, or not to be: that is the question."
    assert ours(text).input_ids == theirs(text).input_ids


# --------------------------------------------------------------------- cache
def test_cache_config_defaults_and_swap_bytes():
    config = CacheConfig()
    assert (config.block_size, config.gpu_memory_utilization, config.enable_prefix_caching) == (16, 0.9, False)
    assert CacheConfig(swap_space=0.5).swap_space_bytes == 1 << 29


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(block_size=12), dict(gpu_memory_utilization=0.0),
                                    dict(gpu_memory_utilization=1.5), dict(swap_space=-1),
                                    dict(num_gpu_blocks_override=0), dict(cache_dtype="fp8")])
def test_cache_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        CacheConfig(**kwargs)


def test_cache_config_takes_vllms_positional_order():
    # vLLM 0.6.3: CacheConfig(block_size, gpu_memory_utilization, swap_space, cache_dtype,
    # is_attention_free, num_gpu_blocks_override, sliding_window, enable_prefix_caching, cpu_offload_gb)
    config = CacheConfig(8, 0.5, 1.0, "auto", False, 12)
    assert (config.block_size, config.gpu_memory_utilization, config.swap_space) == (8, 0.5, 1.0)
    assert (config.cache_dtype, config.num_gpu_blocks_override) == ("auto", 12)
    config = CacheConfig(8, 0.5, 1.0, "auto", False, None, None, True, 0)
    assert config.enable_prefix_caching and config.num_gpu_blocks_override is None
    with pytest.raises(ValueError, match="is_attention_free"):
        CacheConfig(8, 0.5, 1.0, "auto", 12)  # a fifth positional means is_attention_free, as in vLLM
    with pytest.raises(TypeError):
        CacheConfig(8, 0.5, 1.0, "auto", False, None, None, True, 0, 64)  # num_gpu_blocks: keyword only
    assert CacheConfig(num_gpu_blocks=64, num_cpu_blocks=0).num_gpu_blocks == 64


@pytest.mark.parametrize("kwargs, reason", [(dict(is_attention_free=True), "is_attention_free"),
                                            (dict(sliding_window=4096), "sliding_window"),
                                            (dict(cpu_offload_gb=2), "cpu_offload_gb")])
def test_cache_config_refuses_vllm_settings_it_does_not_build(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        CacheConfig(**kwargs)


# ---------------------------------------------------------------------- LoRA
def test_lora_config_takes_vllms_positional_order():
    # vLLM 0.6.3: LoRAConfig(max_lora_rank, max_loras, fully_sharded_loras, max_cpu_loras,
    # lora_dtype, lora_extra_vocab_size, long_lora_scaling_factors)
    config = LoRAConfig(16, 2)
    assert (config.max_lora_rank, config.max_loras, config.max_cpu_loras) == (16, 2, 2)
    config = LoRAConfig(8, 2, False, 4, None, 256, None)
    assert (config.max_lora_rank, config.max_loras, config.max_cpu_loras) == (8, 2, 4)
    assert (config.fully_sharded_loras, config.lora_dtype, config.lora_extra_vocab_size) == (False, None, 256)
    assert LoRAConfig(lora_dtype="auto").lora_dtype == "auto"


@pytest.mark.parametrize("kwargs, reason", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras"), (dict(fully_sharded_loras=True), "fully_sharded_loras"),
    (dict(lora_dtype="float16"), "lora_dtype"), (dict(lora_extra_vocab_size=100), "lora_extra_vocab_size"),
    (dict(long_lora_scaling_factors=(4.0,)), "long_lora_scaling_factors")])
def test_lora_config_rejects_what_it_cannot_serve(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        LoRAConfig(**kwargs)


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
def test_parallel_config_sizes_and_backend():
    assert ParallelConfig().world_size == 1 and ParallelConfig().distributed_executor_backend == "uni"
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert config.world_size == 4 and config.distributed_executor_backend == "mp"  # vLLM's one-node default
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="one process"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="disable_custom_all_reduce"):
        ParallelConfig(tensor_parallel_size=2, disable_custom_all_reduce="yes")


def test_device_config(monkeypatch):
    import torch

    assert DeviceConfig().device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert DeviceConfig("cpu").device_type == "cpu"
    with pytest.raises(ValueError):
        DeviceConfig("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert DeviceConfig("cuda:1").device_type == "cuda"
    with pytest.raises(ValueError, match="2 GPU"):
        DeviceConfig("cuda:2")


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="torch sees no GPU.*use device='cpu'"):
            DeviceConfig(device)
    assert DeviceConfig("auto").device == "cpu"


# ------------------------------------------------------------ model sources
# transformers would report a missing folder as "Repo id must be in the form ..." from deep
# inside the hub client, and retry an unreachable hub for ~25 s: ModelConfig says why at once.
@pytest.mark.parametrize("name", ["/no/such/checkpoint", "./no-such-folder", "~/no/such/folder", "a/b/c"])
def test_a_missing_folder_is_named_as_one(name):
    with pytest.raises(ValueError, match="no such folder"):
        ModelConfig(name)


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        ModelConfig(str(tmp_path / "weights.bin"))


def test_an_uncached_hub_id_fails_fast_offline(monkeypatch, tmp_path):
    import time

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ValueError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        ModelConfig("nobody/no-such-model")
    assert time.monotonic() - start < 2.0  # no retries


def test_an_uncached_hub_id_with_the_hub_unreachable_fails_fast(monkeypatch, tmp_path):
    import time

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    # Port 9 on loopback: nothing listens, the connection is refused at once.
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ValueError, match="cannot be reached"):
        ModelConfig("nobody/no-such-model")
    assert time.monotonic() - start < 5.0


def test_an_invalid_hub_id_is_named(monkeypatch):
    with pytest.raises(ValueError, match="neither a folder nor a valid hub id"):
        ModelConfig("not a model")


def test_multi_step_is_the_default_only_where_it_can_run():
    """num_scheduler_steps=None: 8 on a GPU with graphs and plain workers (tensor parallel
    ones too), else 1; a value given is kept."""
    from types import SimpleNamespace

    from minivllm.engine.arg_utils import DEFAULT_GPU_SCHEDULER_STEPS, EngineArgs

    gpu, cpu = SimpleNamespace(device_type="cuda"), SimpleNamespace(device_type="cpu")
    assert EngineArgs()._num_scheduler_steps(gpu) == DEFAULT_GPU_SCHEDULER_STEPS == 8
    assert EngineArgs()._num_scheduler_steps(cpu) == 1
    assert EngineArgs(tensor_parallel_size=2)._num_scheduler_steps(gpu) == 8
    assert EngineArgs(enable_lora=True)._num_scheduler_steps(gpu) == 8
    assert EngineArgs(kv_transfer_config=KVTransferConfig("CPUOffloadConnector"))._num_scheduler_steps(gpu) == 8
    for ruled_out in ({"enforce_eager": True}, {"pipeline_parallel_size": 2},
                      {"speculative_model": "[ngram]"}):
        assert EngineArgs(**ruled_out)._num_scheduler_steps(gpu) == 1, ruled_out
    assert EngineArgs(num_scheduler_steps=3)._num_scheduler_steps(gpu) == 3
    assert EngineArgs(device="cpu").create_engine_config().scheduler_config.num_scheduler_steps == 1


@pytest.mark.parametrize("value", [1.5, "3", True, 0])
def test_num_speculative_tokens_must_be_a_positive_integer(value):
    """1.5 or "3" is refused when the config is built, not inside the first decode step."""
    from minivllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        EngineArgs(device="cpu", speculative_model="[ngram]", num_speculative_tokens=value,
                   ngram_prompt_lookup_max=2).create_engine_config()
