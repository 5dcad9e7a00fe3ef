"""The `mp` executor: every block comes back under preemption and aborts with the model split
over processes; a killed worker is a clear error within seconds; nothing outlives shutdown."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from minivllm import LLM
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.profiler import TORCH_PROFILER_DIR_ENV
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.multiproc_executor import MultiprocessingDistributedExecutor
from minivllm.sampling_params import SamplingParams

import engine_test_checkpoints as checkpoints
from engine_test_checkpoints import assert_all_blocks_free, mixed_prompts

# A killed worker must be reported within this many seconds (no hang until a timeout).
DEATH_REPORTED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp-llama") / "llama"
    return str(path), checkpoints.save_checkpoint("llama", path)


class StatsCollector:
    def __init__(self):
        self.stats = []

    def log(self, stats) -> None:
        self.stats.append(stats)


def make_engine(path: str, tp: int = 2, pp: int = 1, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8, tensor_parallel_size=tp,
                                                 pipeline_parallel_size=pp, **kwargs))


def worker_pids(engine: LLMEngine) -> list[int]:
    executor = engine.model_executor
    assert isinstance(executor, MultiprocessingDistributedExecutor)
    return [worker.process.pid for worker in executor.workers]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent, the fork server) no longer runs.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_and_aborts_return_every_block(llama, preemption_mode):
    """TP=2 x PP=2 with a pool too small for the batch: requests are preempted (swap moves
    every stage's and every rank's blocks), two are aborted midway; tokens still match
    transformers and every block is free at the end."""
    path, hf_model = llama
    prompts = mixed_prompts(6, max_len=20)
    engine = make_engine(path, tp=2, pp=2, num_gpu_blocks_override=8, preemption_mode=preemption_mode)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        collector = StatsCollector()
        engine.add_logger("collector", collector)
        results, step = {}, 0
        while engine.has_unfinished_requests():
            if step == 2:
                engine.abort_request(["1", "4"])
            for output in engine.step():
                if output.finished and output.outputs[0].finish_reason == "length":
                    results[output.request_id] = output.outputs[0].token_ids
            step += 1
        assert set(results) == {"0", "2", "3", "5"}
        for request_id, tokens in results.items():
            assert tokens == checkpoints.hf_greedy(hf_model, prompts[int(request_id)], 6)
        assert sum(stats.num_preemption_iter for stats in collector.stats) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_killed_worker_is_a_clear_error_within_seconds(llama, tp, pp):
    """TP: the next call finds the process dead. PP: the driver's send to the dead last stage
    fails in gloo, and the executor names the dead worker rather than the socket error."""
    path, _ = llama
    engine = make_engine(path, tp=tp, pp=pp)
    try:
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, temperature=0.0))
        engine.step()
        (pid,) = worker_pids(engine)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"worker rank 1 \\(pid {pid}\\) died with exit code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < DEATH_REPORTED_WITHIN_S
    finally:
        engine.shutdown()


def test_shutdown_leaves_no_process_behind(llama):
    path, _ = llama
    engine = make_engine(path, tp=2, pp=2)
    pids = worker_pids(engine)
    assert len(pids) == 3 and all(is_running(pid) for pid in pids)
    engine.shutdown()
    deadline = time.monotonic() + DEATH_REPORTED_WITHIN_S
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_running(pid) for pid in pids)


ENGINE_THEN_WAIT = """
import sys, time
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
if __name__ == "__main__":  # the workers' processes import this module
    engine = LLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], device="cpu", block_size=8,
                                                   tensor_parallel_size=2))
    print(*[w.process.pid for w in engine.model_executor.workers], flush=True)
    time.sleep(600)
"""


def test_workers_of_a_killed_engine_process_exit_by_themselves(llama, tmp_path):
    """The engine's process gets no chance to clean up (SIGKILL): its workers notice within
    a poll interval and exit at once, without waiting on a teardown with a dead peer."""
    import select
    import subprocess
    import sys

    path, _ = llama
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_THEN_WAIT)
    engine_process = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([engine_process.stdout], [], [], 120)  # the engine started, or fail
        assert ready, "the engine process printed no worker pid within 120 s"
        pids = [int(pid) for pid in engine_process.stdout.readline().split()]
        assert len(pids) == 1 and is_running(pids[0])
        engine_process.kill()
        engine_process.wait()
        deadline = time.monotonic() + DEATH_REPORTED_WITHIN_S
        while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(is_running(pid) for pid in pids)
    finally:
        engine_process.kill()


def test_start_and_stop_profile_write_one_trace_per_rank(llama, tmp_path, monkeypatch):
    """vLLM's profiler API at TP=2: between `start_profile` and `stop_profile` every rank records
    its own ops, the tensor-parallel all-reduce among them, into a Chrome trace of its own."""
    monkeypatch.setenv(TORCH_PROFILER_DIR_ENV, str(tmp_path / "traces"))
    engine = make_engine(llama[0])
    try:
        engine.start_profile()
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        traces = engine.stop_profile()
    finally:
        engine.shutdown()
    assert [os.path.basename(t) for t in traces] == ["rank0-0.pt.trace.json", "rank1-0.pt.trace.json"]
    for trace in traces:
        assert os.path.dirname(trace) == str(tmp_path / "traces")
        with open(trace) as f:
            names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
        assert "aten::linear" in names and any("all_reduce" in name for name in names), sorted(names)[:50]


def test_profiling_one_worker_in_process_through_llm(llama, tmp_path, monkeypatch):
    """The single-process executor too, from `LLM`; without a trace folder, a clear error."""
    llm = LLM(model=llama[0], device="cpu", block_size=8)
    monkeypatch.delenv(TORCH_PROFILER_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TORCH_PROFILER_DIR_ENV):
        llm.start_profile()
    monkeypatch.setenv(TORCH_PROFILER_DIR_ENV, str(tmp_path))
    llm.start_profile()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    (trace,) = llm.stop_profile()
    assert trace == str(tmp_path / "rank0-0.pt.trace.json")
    with open(trace) as f:
        assert any(event.get("name") == "aten::linear" for event in json.load(f)["traceEvents"])
    with pytest.raises(RuntimeError, match="without start_profile"):
        llm.stop_profile()
