"""Ends the engine's process when a dead worker leaves the driver's GPU waiting forever.

Why this exists: with the custom all-reduce (`distributed/symm_mem.py`) a rank spins inside
a kernel until its peer writes a flag into its memory. If the peer dies mid-step, the flag
never comes, the driver's GPU never finishes the step, and the engine's thread, blocked
reading that step's tokens, can raise nothing. (NCCL's kernels can be aborted; the `mp`
executor then raises `WorkerDiedError` on its own.) vLLM v1 faces the same and answers the
same way: its executor watches the worker processes and shuts the engine down when one dies.

The watchdog sleeps on the workers' process sentinels (no polling). When one exits, it keeps
asking, until the engine reports the death itself (the executor calls `stand_down`), whether
the driver's GPU can still finish what it has queued: an idle engine passes, and reports the
death on its next call. If queued work has not finished after `STUCK_AFTER_DEATH_S`, the
engine is stuck for good: the watchdog logs which rank died and ends the process with
`EXIT_CODE`, within seconds instead of NCCL's 60 s timeout. In the OpenAI server that process
is the engine process, and the server's client reports the engine dead to every request.
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

# After a worker dies, how long the engine has to report it (or its GPU to finish) before
# the watchdog decides the engine's thread waits on a step that cannot complete.
STUCK_AFTER_DEATH_S = 3.0
# How often the wait for a death wakes up to see whether the watchdog was stood down.
WAKE_INTERVAL_S = 0.5
EXIT_CODE = 70  # EX_SOFTWARE: an internal error the process cannot recover from


class DeadPeerWatchdog:
    """Watches `workers` (each with `.rank` and `.process`) from a daemon thread.

    After a worker has died, `gpu_drained()` is called every `WAKE_INTERVAL_S` or so; it
    returns a check that turns true once everything the driver had queued on its GPU by then
    has finished (true at once on an idle GPU).
    """

    def __init__(self, workers: Sequence, gpu_drained: Callable[[], Callable[[], bool]]) -> None:
        self.workers = list(workers)
        self.gpu_drained = gpu_drained
        self._stood_down = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="minivllm-dead-peer-watchdog", daemon=True)
        self._thread.start()

    def stand_down(self) -> None:
        """The engine reported the death itself, or is shutting down: nothing left to do."""
        self._stood_down.set()

    def _watch(self) -> None:
        sentinels = {worker.process.sentinel: worker for worker in self.workers}
        while not self._stood_down.is_set():
            exited = wait(list(sentinels), timeout=WAKE_INTERVAL_S)
            if exited:
                self._after_death(sentinels[exited[0]])
                return

    def _after_death(self, worker) -> None:
        # Until the engine reports the death (or shuts down), every batch of work queued on the
        # driver's GPU must finish within the grace period; an idle engine passes each check.
        while not self._stood_down.is_set():
            drained = self.gpu_drained()
            deadline = time.monotonic() + STUCK_AFTER_DEATH_S
            while not drained():
                if self._stood_down.wait(0.05):
                    return
                if time.monotonic() > deadline:
                    self._end_process(worker)
                    return
            self._stood_down.wait(WAKE_INTERVAL_S)

    def _end_process(self, worker) -> None:
        message = (f"worker rank {worker.rank} (pid {worker.process.pid}) died while the driver's GPU waits for it "
                   f"inside the custom all-reduce, a wait that cannot end: ending this process (exit code "
                   f"{EXIT_CODE}). disable_custom_all_reduce=True uses NCCL, whose failure raises WorkerDiedError "
                   f"instead.")
        logger.critical(message)
        print(message, file=sys.stderr, flush=True)  # also where logging is not configured
        os._exit(EXIT_CODE)
