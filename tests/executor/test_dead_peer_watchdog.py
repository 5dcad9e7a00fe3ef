"""The dead-peer watchdog: with the custom all-reduce, a worker that dies mid-step leaves the
driver's GPU waiting forever, so the engine's process must end within seconds, naming the dead
rank, unless the engine reported the death itself or its GPU could still finish."""

from __future__ import annotations

import os
import signal
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
    """An idle GPU passes the first checks; a step queued later (its all-reduce waiting for the
    dead peer) does not. Also after the engine reported the death: nothing stands it down."""
    calls, exited = exits
    monkeypatch.setattr(dead_peer_watchdog, "WAKE_INTERVAL_S", 0.05)
    checks = iter([lambda: True, lambda: True])  # then: work that never finishes
    worker = FakeWorker(1)
    DeadPeerWatchdog([worker], gpu_drained=lambda: next(checks, lambda: False))
    worker.die()
    assert exited.wait(5 * GRACE_S + 2)
    assert calls == [EXIT_CODE]


@pytest.mark.parametrize("probe", ["blocks", "raises", "its check raises"])
def test_a_gpu_that_cannot_even_be_probed_counts_as_stuck(exits, probe):
    """Recording an event waits when the launch queue is full; a CUDA error raises."""
    calls, exited = exits

    def gpu_drained():
        if probe == "blocks":
            threading.Event().wait()
        if probe == "raises":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return lambda: 1 / 0

    worker = FakeWorker(1)
    DeadPeerWatchdog([worker], gpu_drained=gpu_drained)
    worker.die()
    assert exited.wait(5 * GRACE_S + 2)
    assert calls == [EXIT_CODE]


def test_shutting_down_after_a_death_still_ends_a_stuck_process(exits):
    calls, exited = exits
    worker = FakeWorker(1)
    watchdog = DeadPeerWatchdog([worker], gpu_drained=lambda: (lambda: False))
    worker.die()
    time.sleep(GRACE_S / 3)
    watchdog.engine_shutting_down()
    assert exited.wait(5 * GRACE_S + 2)
    assert calls == [EXIT_CODE]


@pytest.mark.parametrize("how", ["the GPU finishes its work", "the workers stop for a shutdown"])
def test_the_process_lives_on(exits, how):
    calls, exited = exits
    worker = FakeWorker(1)
    watchdog = DeadPeerWatchdog([worker], gpu_drained=lambda: (lambda: True))
    try:
        if how == "the workers stop for a shutdown":
            watchdog.engine_shutting_down()
        worker.die()
        assert not exited.wait(3 * GRACE_S + 1)
        assert calls == []
    finally:
        watchdog.engine_shutting_down()


ENGINE_THEN_KILL = """
import os, signal, sys, time
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.multiproc_executor import MultiprocessingDistributedExecutor
from minivllm.sampling_params import SamplingParams

if __name__ == "__main__":  # the workers' processes import this module
    mode = sys.argv[2]
    # As on GPUs with the custom all-reduce; the driver's GPU finishes its work or never does.
    MultiprocessingDistributedExecutor._peer_death_can_stall_the_driver = lambda self: True
    MultiprocessingDistributedExecutor._driver_gpu_drained = lambda self: (lambda: mode == "reported")
    engine = LLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], device="cpu", block_size=8,
                                                   tensor_parallel_size=2))
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    os.kill(engine.model_executor.workers[0].process.pid, signal.SIGKILL)
    print("killed", flush=True)
    if mode == "blocked":
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

# TP=2 x PP=2: rank 3 dies at the end of a step; rank 2, its TP peer, then waits (on GPUs, for
# ever inside the custom all-reduce; here for 60 s), while the driver's GPU is idle.
ENGINE_WITH_A_STUCK_PEER = """
import os, sys, time
from minivllm.worker.pipeline_worker import PipelineStageWorker as Worker  # every rank's, with TP x PP

MARK = sys.argv[2]
execute_model = Worker.execute_model

def execute_then_fail(self, request):
    out = execute_model(self, request)
    if os.path.exists(MARK):
        if self.rank == 3:
            os._exit(1)
        if self.rank == 2:
            time.sleep(60)
    return out

Worker.execute_model = execute_then_fail

if __name__ == "__main__":
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.executor.distributed_executor import WorkerDiedError
    from minivllm.executor.multiproc_executor import MultiprocessingDistributedExecutor
    from minivllm.sampling_params import SamplingParams
    MultiprocessingDistributedExecutor._peer_death_can_stall_the_driver = lambda self: True
    MultiprocessingDistributedExecutor._driver_gpu_drained = lambda self: (lambda: True)
    engine = LLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], device="cpu", block_size=8,
                                                   tensor_parallel_size=2, pipeline_parallel_size=2))
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    open(MARK, "w").close()
    print("killed", flush=True)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except WorkerDiedError as error:
        print("reported", error, flush=True)
    os._exit(0)  # rank 2 still sleeps: not what is tested here
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("watchdog-llama") / "llama"
    checkpoints.save_checkpoint("llama", path)
    return str(path)


def run_script(tmp_path, text: str, *args: str, until: str | None = None) -> tuple[int | None, str, str, float]:
    """Exit code, output after the "killed" line, stderr, and seconds from that line to the end
    (or, with `until`, to the first line starting with it; the processes are then killed)."""
    script = tmp_path / "engine.py"
    script.write_text(text)
    process = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first_line = process.stdout.readline()
        killed_at = time.monotonic()
        if until is not None:  # its workers may outlive it, holding the pipes open
            line = process.stdout.readline()
            assert line.startswith(until), line
            return None, line, "", time.monotonic() - killed_at
        stdout, stderr = process.communicate(timeout=120)
        seconds = time.monotonic() - killed_at
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the engine and any worker left behind
        process.wait()
    assert first_line.strip() == "killed", stderr[-3000:]
    return process.returncode, stdout, stderr, seconds


def test_an_engine_blocked_when_its_worker_dies_ends_within_seconds(llama, tmp_path):
    returncode, stdout, stderr, seconds = run_script(tmp_path, ENGINE_THEN_KILL, llama, "blocked")
    assert returncode == EXIT_CODE, stderr[-2000:]
    assert "ended normally" not in stdout
    assert "worker rank 1" in stderr and "the driver's GPU still waits" in stderr
    assert seconds < dead_peer_watchdog.STUCK_AFTER_DEATH_S + 10


def test_an_engine_that_reports_the_death_keeps_its_process_if_its_gpu_finishes(llama, tmp_path):
    grace = dead_peer_watchdog.STUCK_AFTER_DEATH_S
    returncode, stdout, stderr, _ = run_script(tmp_path, ENGINE_THEN_KILL, llama, "reported", str(grace + 1.0))
    assert returncode == 0, stderr[-2000:]
    assert stdout.split() == ["reported", "ended", "normally"]


def test_steps_left_waiting_for_the_dead_rank_end_the_process_even_after_the_report(llama, tmp_path):
    grace = dead_peer_watchdog.STUCK_AFTER_DEATH_S
    returncode, stdout, stderr, _ = run_script(tmp_path, ENGINE_THEN_KILL, llama, "reported-stuck", str(grace + 5.0))
    assert returncode == EXIT_CODE, stderr[-2000:]
    assert stdout.split() == ["reported"]


def test_a_rank_waiting_for_a_dead_peer_does_not_hide_its_death(llama, tmp_path):
    """TP x PP: the executor waits for rank 2's answer, which waits for dead rank 3. Every
    worker is checked while it waits, so the death is reported within seconds."""
    _, line, _, seconds = run_script(tmp_path, ENGINE_WITH_A_STUCK_PEER, llama, str(tmp_path / "fail-now"),
                                     until="reported")
    assert line.startswith("reported worker rank 3")
    assert seconds < 15  # rank 2 answers only after 60 s
