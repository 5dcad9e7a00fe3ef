"""Ends the engine's process when a dead worker leaves the driver's GPU waiting forever.

Why this exists: with the custom all-reduce (`distributed/symm_mem.py`) a rank spins inside
a kernel until its peer writes a flag into its memory. If the peer dies mid-step, the flag
never comes, the driver's GPU never finishes the step, and the engine's thread, blocked
reading that step's tokens, can raise nothing. (NCCL's kernels can be aborted; the `mp`
executor then raises `WorkerDiedError` on its own.) vLLM v1 faces the same and answers the
same way: its executor watches the worker processes and shuts the engine down when one dies.

The watchdog sleeps on the workers' process sentinels (no polling). Once one has exited, it
checks every `WAKE_INTERVAL_S` that the driver's GPU can still finish what it has queued. An
idle GPU passes at once: the engine reports the death on its next call (`WorkerDiedError`).
Queued work that has not finished within `STUCK_AFTER_DEATH_S` never will: the watchdog logs
which rank died and ends the process with `EXIT_CODE`, within seconds instead of NCCL's 60 s
timeout. It keeps checking after the engine has raised `WorkerDiedError`, since steps queued
before the death may still wait for the dead rank, and any later wait on that GPU (the next
engine of a notebook, a synchronize) would hang. In the OpenAI server the process it ends is
the engine process, and the server's client reports the engine dead to every request.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)

# How long work queued on the driver's GPU may take to finish once a worker has died.
STUCK_AFTER_DEATH_S = 3.0
# How often the watchdog wakes up: to see whether the engine shut down, and, after a death,
# to check the GPU again.
WAKE_INTERVAL_S = 0.5
EXIT_CODE = 70  # EX_SOFTWARE: an internal error the process cannot recover from


class DeadPeerWatchdog:
    """Watches `workers` (each with `.rank` and `.process`) from a daemon thread.

    `gpu_drained()` returns a check that turns true once everything the driver has queued on
    its GPU by now has finished (true at once on an idle GPU). It is called in a thread of its
    own: on a GPU whose launch queue is full, even recording an event waits.
    """

    def __init__(self, workers: Sequence, gpu_drained: Callable[[], Callable[[], bool]]) -> None:
        self.workers = list(workers)
        self.gpu_drained = gpu_drained
        self._shutting_down = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="minivllm-dead-peer-watchdog", daemon=True)
        self._thread.start()

    def engine_shutting_down(self) -> None:
        """Workers that exit from now on were asked to. After a death the watchdog still waits
        for the GPU to finish (or ends the process), then stops."""
        self._shutting_down.set()

    def _watch(self) -> None:
        sentinels = {worker.process.sentinel: worker for worker in self.workers}
        while not self._shutting_down.is_set():
            exited = wait(list(sentinels), timeout=WAKE_INTERVAL_S)
            if exited and not self._shutting_down.is_set():
                self._after_death(sentinels[exited[0]])
                return

    def _after_death(self, worker) -> None:
        while True:
            if not self._gpu_finishes_within(STUCK_AFTER_DEATH_S):
                self._end_process(worker)
                return
            if self._shutting_down.wait(WAKE_INTERVAL_S):
                return

    def _gpu_finishes_within(self, seconds: float) -> bool:
        probe: dict[str, Callable[[], bool]] = {}

        def record() -> None:
            try:
                probe["drained"] = self.gpu_drained()
            except Exception:  # a CUDA error: nothing queued will finish either
                probe["drained"] = lambda: False

        threading.Thread(target=record, name="minivllm-dead-peer-probe", daemon=True).start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            drained = probe.get("drained")
            if drained is not None and _true_or_false(drained):
                return True
            time.sleep(0.05)
        return False

    def _end_process(self, worker) -> None:
        message = (f"worker rank {worker.rank} (pid {worker.process.pid}) died and the driver's GPU still waits for "
                   f"it inside the custom all-reduce, a wait that cannot end: ending this process (exit code "
                   f"{EXIT_CODE}). disable_custom_all_reduce=True uses NCCL, whose failure raises WorkerDiedError "
                   f"instead.")
        logger.critical(message)
        print(message, file=sys.stderr, flush=True)  # also where logging is not configured
        os._exit(EXIT_CODE)


def _true_or_false(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:  # a sticky CUDA error: the queued work will not finish
        return False
