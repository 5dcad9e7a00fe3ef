"""One worker in a process of its own, reached through two queues (vLLM's
`vllm/executor/multiproc_worker_utils.py`, without its result-handler thread).

The parent puts `(method, args)`, pickled (`pack_task`), on the task queue; the child runs
`method(worker, *args)` and puts `(ok, result or traceback text)` on the result queue. `None` asks it to stop. The
first answer, before any task, says the worker was built (imports and config fine), so a
child that fails to start is reported at once instead of as a rendezvous timeout. A child
whose parent is gone (killed without a chance to clean up) exits by itself: no orphans. A
step's `ExecuteModelRequest` crosses the queue as deltas after a request's first step
(`metadata_delta.py`): the prompts are not pickled again every step.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from minivllm.config import EngineConfig
from minivllm.executor.metadata_delta import MetadataDecoder, MetadataEncoder

logger = logging.getLogger(__name__)

# How often a waiting side checks that the other is still alive, in seconds.
POLL_INTERVAL_S = 0.5
# How long shutdown waits for a worker to exit by itself before terminating it.
JOIN_TIMEOUT_S = 5.0


class ProcessWorkerWrapper:
    """A `Worker` of rank `rank` in a child process of `context` (forkserver or spawn: never a
    fork of the engine's process, whose threads and CUDA state a child must not inherit)."""

    def __init__(self, context, engine_config: EngineConfig, rank: int, local_rank: int,
                 distributed_init_method: str) -> None:
        self.rank = rank
        self.tasks = context.Queue()
        self.results = context.Queue()
        self.process = context.Process(
            target=_worker_main, name=f"minivllm-worker-{rank}", daemon=True,
            args=(engine_config, rank, local_rank, distributed_init_method, self.tasks, self.results, os.getpid()))
        self.process.start()

    def submit(self, task: bytes) -> None:
        """Send a call packed by `pack_task` (the same bytes go to every worker)."""
        self.tasks.put(task)

    def result(self, died_error: type[Exception], while_waiting: Callable[[], None] | None = None) -> Any:
        """Wait for the answer to the last `submit`; `died_error` if the process is gone.
        `while_waiting` runs every POLL_INTERVAL_S until the answer comes (it may raise)."""
        while True:
            try:
                ok, value = self.results.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                if while_waiting is not None:
                    while_waiting()
                if not self.process.is_alive():
                    raise died_error(f"worker rank {self.rank} (pid {self.process.pid}) died with exit code "
                                     f"{self.process.exitcode}; the engine cannot continue without it.") from None
                continue
            if not ok:
                raise RuntimeError(f"worker rank {self.rank} failed:\n{value}")
            return value

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def request_stop(self) -> None:
        """Ask the process to leave its process groups and exit; do not wait."""
        if self.process.is_alive():
            try:
                self.tasks.put(None)
            except (OSError, ValueError):  # queue already closed
                pass

    def stop(self) -> None:
        """Ask the process to exit; terminate it if it does not within JOIN_TIMEOUT_S."""
        if self.process.is_alive():
            self.request_stop()
            self.process.join(JOIN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(JOIN_TIMEOUT_S)
        self.tasks.close()
        self.results.close()


def pack_task(encoder: MetadataEncoder, method, args: tuple) -> bytes:
    """One call for every worker process: its requests as deltas (`metadata_delta.py`; the
    workers all receive the same calls, so one encoder serves them all), pickled once, here
    rather than later in each queue's feeder thread, since the encoder has just recorded what
    the workers will hold and the engine's sequences may change after this returns."""
    return bytes(ForkingPickler.dumps((method, encoder.encode_args(args))))


def _worker_main(engine_config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str,
                 tasks, results, parent_pid: int) -> None:
    """The child process: build the worker, then serve calls until told to stop."""
    from minivllm.worker.selector import worker_class  # in the child: torch is imported here

    try:
        cls = worker_class(engine_config)
        worker = cls(engine_config, local_rank=local_rank, rank=rank, distributed_init_method=distributed_init_method,
                     is_driver_worker=False)
    except Exception:
        results.put((False, traceback.format_exc()))
        return
    results.put((True, "ready"))
    decoder = MetadataDecoder()
    try:
        while True:
            try:
                task = tasks.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                if not _is_alive(parent_pid):
                    # The engine's process is gone: so are we, at once. A graceful teardown
                    # would wait on communicators whose peer no longer exists.
                    os._exit(1)
                continue
            if task is None:
                return
            try:
                method, args = pickle.loads(task)
                results.put((True, method(worker, *decoder.decode_args(args))))
            except Exception:
                results.put((False, traceback.format_exc()))
    finally:
        worker.shutdown()


def _is_alive(pid: int) -> bool:
    """Whether process `pid` exists (the engine's process; a forkserver child's parent is the
    fork server, so os.getppid() cannot tell)."""
    try:
        os.kill(pid, 0)  # signal 0: no signal sent, only the existence check
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
