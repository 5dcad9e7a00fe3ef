"""The connectors on a GPU: copies on a side stream, pinned host memory, per-layer waits.

Run on the GPU machine: `pytest -m gpu tests/distributed/kv_transfer`.
"""

from __future__ import annotations

import pytest
import torch

import kv_transfer_testing as kvt
from minivllm.config import KVTransferConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cuda_engine(config=None, **kwargs):
    return kvt.make_engine(config, device="cuda", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def gpu_reference():
    return kvt.tokens(kvt.run(_cuda_engine()))


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_shared_storage_restart_on_gpu(tmp_path, attention_backend):
    # Against an engine of the SAME backend without a connector: the two backends reduce in
    # different orders on a GPU, so a greedy near-tie may break differently.
    reference = kvt.tokens(kvt.run(_cuda_engine(attention_backend=attention_backend)))
    config = kvt.shared_storage(tmp_path)
    assert kvt.tokens(kvt.run(_cuda_engine(config, attention_backend=attention_backend))) == reference
    engine = _cuda_engine(config, attention_backend=attention_backend)
    results = kvt.run(engine)
    assert kvt.tokens(results) == reference
    assert all(cached > 0 for _, cached in results.values())
    assert engine.kv_transfer_stats.num_tokens_loaded > 0 and engine.kv_transfer_stats.num_load_errors == 0


def test_cpu_offload_on_gpu_uses_pinned_memory_and_matches(gpu_reference):
    engine = _cuda_engine(KVTransferConfig("CPUOffloadConnector", "kv_both", {"num_cpu_blocks": 64}))
    assert kvt.tokens(kvt.run(engine)) == gpu_reference
    again = kvt.run(engine)
    assert kvt.tokens(again) == gpu_reference
    assert all(cached > 0 for _, cached in again.values())
    worker_connector = engine.model_executor.driver_worker.model_runner.kv_connector
    assert worker_connector.pool.is_pinned()
    assert worker_connector.transfer.stream is not None


def test_damaged_file_recomputed_on_gpu(tmp_path, gpu_reference):
    config = kvt.shared_storage(tmp_path)
    kvt.run(_cuda_engine(config))
    for path in sorted(tmp_path.rglob("*.kv"))[:3]:
        path.write_bytes(path.read_bytes()[:-7])
    engine = _cuda_engine(config)
    assert kvt.tokens(kvt.run(engine)) == gpu_reference
    assert engine.kv_transfer_stats.num_load_errors >= 3


def test_producer_consumer_on_gpu(tmp_path, gpu_reference):
    kvt.run(_cuda_engine(kvt.shared_storage(tmp_path, "kv_producer")), max_tokens=1)
    assert kvt.tokens(kvt.run(_cuda_engine(kvt.shared_storage(tmp_path, "kv_consumer")))) == gpu_reference


@pytest.mark.parametrize("steps", [1, 8])
def test_decode_steps_replay_graphs_while_loads_run_eagerly(tmp_path, gpu_reference, steps):
    """The consumer loads in its prefill steps (eager: the hooks run) and decodes from captured
    graphs (the steps that move no KV), single-step or multi-step, with the tokens of an engine
    without a connector."""
    from minivllm.worker.cuda_graph_runner import CUDAGraphModelRunner

    kvt.run(_cuda_engine(kvt.shared_storage(tmp_path, "kv_producer")), max_tokens=1)
    consumer = _cuda_engine(kvt.shared_storage(tmp_path, "kv_consumer"), num_scheduler_steps=steps)
    runner = consumer.model_executor.driver_worker.model_runner
    assert isinstance(runner, CUDAGraphModelRunner) and runner.graph_runners
    transferring_at_replay = []
    for graph in runner.graph_runners.values():
        graph.replay = lambda *args, _replay=graph.replay: (transferring_at_replay.append(runner._transfers),
                                                             _replay(*args))[1]
    assert kvt.tokens(kvt.run(consumer)) == gpu_reference
    assert transferring_at_replay and not any(transferring_at_replay)  # no step that moved KV replayed
    assert consumer.kv_transfer_stats.num_tokens_loaded > 0
