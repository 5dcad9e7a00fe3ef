"""Worker: how many blocks fit, and the block moves applied before a step."""

import torch

from minivllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from minivllm.sequence import ExecuteModelRequest
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.worker import CPU_KVCACHE_SPACE_ENV, Worker

GiB = 1 << 30


def make_worker(llama_dir, **cache_kwargs) -> Worker:
    model_config = ModelConfig(model=llama_dir[0])
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64)
    worker = Worker(EngineConfig(model_config, CacheConfig(block_size=4, **cache_kwargs), scheduler_config))
    worker.init_device()
    worker.load_model()
    return worker


def test_cpu_blocks_come_from_the_budget_and_swap_space(llama_dir, monkeypatch):
    worker = make_worker(llama_dir, swap_space=0.0001)
    block_bytes = CacheEngine.get_cache_block_size(4, worker.model_config, torch.float32)
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.0001")
    num_gpu, num_cpu = worker.determine_num_available_blocks()
    assert num_gpu == int(0.0001 * GiB // block_bytes)
    assert num_cpu == int(0.0001 * GiB) // block_bytes
    # Both pools are capped at what max_num_seqs sequences of max_model_len could use.
    worker.cache_config.swap_space = 4.0
    # A big budget is capped at what max_num_seqs sequences of max_model_len could use.
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "1")
    assert worker.determine_num_available_blocks() == (8 * 64 // 4, 8 * 64 // 4)


def test_override_wins(llama_dir):
    worker = make_worker(llama_dir, num_gpu_blocks_override=5)
    assert worker.determine_num_available_blocks()[0] == 5


def test_execute_model_applies_swaps_and_copies_before_the_forward(llama_dir):
    worker = make_worker(llama_dir)
    worker.initialize_cache(num_gpu_blocks=6, num_cpu_blocks=4)
    assert worker.cache_engine.num_gpu_blocks == 6 and worker.cache_engine.num_cpu_blocks == 4
    gpu, cpu = worker.cache_engine.gpu_cache, worker.cache_engine.cpu_cache
    for layer in gpu:
        layer[:, 1] = 1.0
        layer[:, 2] = 2.0
    worker.execute_model(ExecuteModelRequest([], blocks_to_swap_out=[(1, 0)], blocks_to_copy=[(2, 5)]))
    for gpu_layer, cpu_layer in zip(gpu, cpu):
        assert torch.all(cpu_layer[:, 0] == 1.0) and torch.all(gpu_layer[:, 5] == 2.0)
    worker.execute_model(ExecuteModelRequest([], blocks_to_swap_in=[(0, 3)]))
    assert all(torch.all(layer[:, 3] == 1.0) for layer in gpu)


def test_a_small_model_runs_on_one_cpu_thread_unless_the_user_chose(llama_dir, monkeypatch):
    """A tiny model's ops are too small to split: threads only wait for each other."""
    from types import SimpleNamespace

    from minivllm.worker.cpu_threads import limit_cpu_threads

    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        make_worker(llama_dir)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        make_worker(llama_dir)
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        big = SimpleNamespace(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, vocab_size=151_936)
        limit_cpu_threads(SimpleNamespace(hf_config=big))  # a Qwen3-0.6B shape keeps its threads
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
