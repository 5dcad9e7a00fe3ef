"""The dead-peer watchdog: with the custom all-reduce, a worker that dies mid-step leaves the
driver's GPU waiting forever, so the engine's process must end within seconds, naming the dead
rank, unless the engine reported the death itself or its GPU could still finish."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from minivllm.executor import dead_peer_watchdog
from minivllm.executor.dead_peer_watchdog import EXIT_CODE, DeadPeerWatchdog

import engine_test_checkpoints as checkpoints

GRACE_S = 0.3  # the tests' STUCK_AFTER_DEATH_S


class FakeWorker:
    """A worker whose process "exits" when `die()` closes the write end of its sentinel pipe."""

    def __init__(self, rank: int) -> None:
        read_end, self._write_end = os.pipe()
        self.rank = rank
        self.process = SimpleNamespace(sentinel=read_end, pid=1000 + rank)

    def die(self) -> None:
        os.close(self._write_end)


@pytest.fixture
def exits(monkeypatch):
    """Records the watchdog's `os._exit` calls instead of ending the test process."""
    calls: list[int] = []
    exited = threading.Event()

    def fake_exit(code: int) -> None:
        calls.append(code)
        exited.set()

    monkeypatch.setattr(dead_peer_watchdog, "STUCK_AFTER_DEATH_S", GRACE_S)
    monkeypatch.setattr(dead_peer_watchdog.os, "_exit", fake_exit)
    return calls, exited


def test_a_death_the_gpu_cannot_get_past_ends_the_process_naming_the_rank(exits, capsys):
    calls, exited = exits
    workers = [FakeWorker(1), FakeWorker(2)]
    DeadPeerWatchdog(workers, gpu_drained=lambda: (lambda: False))
    workers[1].die()
    assert exited.wait(5 * GRACE_S + 2)
    assert calls == [EXIT_CODE]
    assert "worker rank 2 (pid 1002) died" in capsys.readouterr().err


def test_work_queued_after_the_death_that_never_finishes_ends_the_process(exits, monkeypatch):
    """An idle engine passes the first check; a step queued later (its all-reduce waiting for
    the dead peer) does not."""
    calls, exited = exits
    monkeypatch.setattr(dead_peer_watchdog, "WAKE_INTERVAL_S", 0.05)
    checks = iter([lambda: True, lambda: True])  # then: work that never finishes
    worker = FakeWorker(1)
    DeadPeerWatchdog([worker], gpu_drained=lambda: next(checks, lambda: False))
    worker.die()
    assert exited.wait(5 * GRACE_S + 2)
    assert calls == [EXIT_CODE]


@pytest.mark.parametrize("how", ["the engine reports it", "the GPU drains", "the engine shut down first"])
def test_the_watchdog_stands_down(exits, how):
    calls, exited = exits
    worker = FakeWorker(1)
    watchdog = DeadPeerWatchdog([worker], gpu_drained=lambda: (lambda: how == "the GPU drains"))
    try:
        if how == "the engine shut down first":
            watchdog.stand_down()
        worker.die()
        if how == "the engine reports it":
            time.sleep(GRACE_S / 3)
            watchdog.stand_down()
        assert not exited.wait(3 * GRACE_S + 1)
        assert calls == []
    finally:
        watchdog.stand_down()


ENGINE_THEN_KILL = """
import os, signal, sys, time
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.multiproc_executor import MultiprocessingDistributedExecutor
from minivllm.sampling_params import SamplingParams

if __name__ == "__main__":  # the workers' processes import this module
    # As on GPUs with the custom all-reduce: the driver's GPU cannot finish without its peer.
    MultiprocessingDistributedExecutor._peer_death_can_stall_the_driver = lambda self: True
    MultiprocessingDistributedExecutor._driver_gpu_drained = lambda self: (lambda: False)
    engine = LLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], device="cpu", block_size=8,
                                                   tensor_parallel_size=2))
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    os.kill(engine.model_executor.workers[0].process.pid, signal.SIGKILL)
    if sys.argv[2] == "blocked":
        print("waiting", flush=True)
        time.sleep(60)  # as the engine's thread blocked on a GPU wait: nothing reports the death
    else:
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except WorkerDiedError:
            print("reported", flush=True)
        time.sleep(float(sys.argv[3]))  # past the watchdog's grace period
        engine.shutdown()
    print("ended normally", flush=True)
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("watchdog-llama") / "llama"
    checkpoints.save_checkpoint("llama", path)
    return str(path)


def run_engine_script(tmp_path, llama, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_THEN_KILL)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), llama, *args], capture_output=True, text=True, timeout=180)
    return done, time.monotonic() - start


def test_an_engine_blocked_when_its_worker_dies_ends_within_seconds(llama, tmp_path):
    done, _ = run_engine_script(tmp_path, llama, "blocked")
    assert done.returncode == EXIT_CODE, done.stderr[-2000:]
    assert "waiting" in done.stdout and "ended normally" not in done.stdout
    assert "worker rank 1" in done.stderr and "died while the driver's GPU waits" in done.stderr


def test_an_engine_that_reports_the_death_keeps_its_process(llama, tmp_path):
    grace = dead_peer_watchdog.STUCK_AFTER_DEATH_S
    done, _ = run_engine_script(tmp_path, llama, "reported", str(grace + 1.0))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["reported", "ended", "normally"]
