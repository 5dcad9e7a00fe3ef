"""The `mp` executor: one process per rank on this machine; rank 0 in the engine's process.

Mirrors `vllm/executor/multiproc_gpu_executor.py`. Rank 0 (the "driver worker") runs
in-process, so a TP=2 engine starts one extra process. Every call is sent to the other
ranks' task queues first, then run on the driver (so all ranks enter their collectives
together), then every rank's answer is collected: each step is also a health check.

A worker that dies makes the next (or current) call raise `WorkerDiedError` within about
`POLL_INTERVAL_S`, or as soon as the driver's collective sees its peer's socket close;
`shutdown()` stops every process (and a worker whose engine process was killed exits by
itself), so no process outlives its engine. With the custom all-reduce on GPUs a peer's death
can leave the driver waiting on its GPU for good; `dead_peer_watchdog.py` then ends the
engine's process within seconds, naming the dead rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed import DistNetworkError

from minivllm.distributed.parallel_state import get_tp_group
from minivllm.distributed.utils import get_distributed_init_method, get_open_port
from minivllm.executor.dead_peer_watchdog import DeadPeerWatchdog
from minivllm.executor.distributed_executor import DistributedExecutorBase, WorkerDiedError, run_every_step
from minivllm.executor.metadata_delta import MetadataEncoder
from minivllm.executor.multiproc_worker_utils import ProcessWorkerWrapper, pack_task
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.selector import worker_class
from minivllm.worker.worker import Worker

logger = logging.getLogger(__name__)


_RENDEZVOUS_ATTEMPTS = 3
# After the driver's collective fails, how long to wait for a dying peer to be reaped.
_DEATH_GRACE_S = 1.0
# Imported once by the fork server, so each worker starts with torch, minivllm and the
# configs of the supported families loaded (a worker unpickles the checkpoint's config;
# importing its transformers module alone takes over a second).
_PRELOAD = ["minivllm.worker.worker", "minivllm.executor.multiproc_worker_utils",
            *(f"transformers.models.{family}.configuration_{family}" for family in ("llama", "mistral", "qwen2", "qwen3"))]


# vLLM's VLLM_WORKER_MULTIPROC_METHOD: "forkserver" (the default here) or "spawn".
MULTIPROC_METHOD_ENV = "MINIVLLM_WORKER_MULTIPROC_METHOD"


def _outputs_as_they_come(worker: Worker, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
    """The driver's `execute_model` (its subclass's: a multi-step worker's outputs are an
    iterator over steps already queued)."""
    return worker.execute_model(execute_model_req)


def _process_context():
    """"forkserver": a clean server process (no threads, no CUDA context, unlike forking the
    engine's process) that has imported torch once; each worker forks from it in well under
    a second instead of spending seconds on imports as a spawned interpreter would. "spawn"
    (set MINIVLLM_WORKER_MULTIPROC_METHOD=spawn): a fresh interpreter per worker."""
    method = os.environ.get(MULTIPROC_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{MULTIPROC_METHOD_ENV} must be 'forkserver' or 'spawn', got {method!r}.")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    return context


class MultiprocessingDistributedExecutor(DistributedExecutorBase):
    """Rank 0 in this process, ranks 1..world_size-1 in spawned processes."""

    def _init_executor(self) -> None:
        # The rendezvous port is picked free, then bound by the driver a moment later; on a
        # busy machine another process can take it in between (EADDRINUSE): try another.
        for attempt in range(1, _RENDEZVOUS_ATTEMPTS + 1):
            try:
                self._start_workers(get_distributed_init_method("127.0.0.1", get_open_port()))
                return
            except DistNetworkError as error:
                if "EADDRINUSE" not in str(error) or attempt == _RENDEZVOUS_ATTEMPTS:
                    raise
                logger.warning("rendezvous port taken (%s); retrying with another", error)

    def _start_workers(self, init_method: str) -> None:
        world_size = self.engine_config.parallel_config.world_size
        context = _process_context()
        self.workers: list[ProcessWorkerWrapper] = []
        self.driver_worker: Worker | None = None
        self.watchdog: DeadPeerWatchdog | None = None
        self.encoder = MetadataEncoder()  # the workers' copy of every request, sent as deltas
        try:
            self.workers = [ProcessWorkerWrapper(context, self.engine_config, rank, rank, init_method)
                            for rank in range(1, world_size)]
            driver_class = worker_class(self.engine_config)
            self.driver_worker = driver_class(self.engine_config, local_rank=0, rank=0,
                                              distributed_init_method=init_method, is_driver_worker=True)
            for worker in self.workers:  # each child says it started before anyone waits to meet it
                worker.result(WorkerDiedError)
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise
        if self._peer_death_can_stall_the_driver():
            self.watchdog = DeadPeerWatchdog(self.workers, self._driver_gpu_drained)
        logger.info("mp executor: driver in process, %d worker process(es) %s", len(self.workers),
                    [w.process.pid for w in self.workers])

    def _peer_death_can_stall_the_driver(self) -> bool:
        """The driver's TP group all-reduces through symmetric memory, whose kernels wait for
        their peers without a timeout (`distributed/symm_mem.py`; not when it fell back to NCCL)."""
        symm_mem = get_tp_group().symm_mem
        return symm_mem is not None and not symm_mem.disabled

    def _driver_gpu_drained(self) -> Callable[[], bool]:
        """A check that turns true once the driver's GPU has finished all it has queued now
        (the engine computes on the default stream)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.default_stream(self.driver_worker.device))
        return event.query

    def _run_workers(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return self._finish_call(self._start_call(method, args))

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        """Every rank runs the step; when the driver is the output rank (no pipeline stages
        after it) its outputs come back one model step at a time, as in the single-process
        executor, so the engine processes a multi-step run's early steps (and schedules the
        next run) while the GPUs compute the later ones."""
        if self.engine_config.parallel_config.output_rank != 0:
            return super().execute_model(execute_model_req)
        call = self._start_call(run_every_step, (execute_model_req,), driver_method=_outputs_as_they_come)
        return self._finish_call(call)[0]

    def _start_call(self, method: Callable[..., Any], args: tuple, driver_method: Callable[..., Any] | None = None) -> Any:
        """Send the call to every worker, then run it (or `driver_method`) on the driver: the
        driver's result.

        Split from `_finish_call` so that calls can overlap (pipeline virtual engines,
        `executor/virtual_engine.py`): the driver's stage may start the next call while the
        later stages still work on this one."""
        self.check_health()
        task = pack_task(self.encoder, method, args)
        for worker in self.workers:
            worker.submit(task)
        try:
            return (driver_method or method)(self.driver_worker, *args)
        except Exception as error:
            # A collective that fails ("connection reset by peer") usually means a peer died:
            # that is the cause worth reporting. It may take a moment to be reaped.
            for worker in self.workers:
                worker.process.join(_DEATH_GRACE_S / max(1, len(self.workers)))
            self.check_health()
            self._collect()  # the live workers' answers to this call, so none is read later
            raise error

    def _finish_call(self, driver_result: Any) -> list[Any]:
        """Every rank's result of the oldest unfinished call, in rank order."""
        results, errors = self._collect()
        if errors:
            raise errors[0]
        return [driver_result, *results]

    def _collect(self) -> tuple[list[Any], list[Exception]]:
        """Every worker's answer to the last call (all of them, even after a failure)."""
        results, errors = [], []
        for worker in self.workers:
            try:
                # While one worker's answer is awaited, another may die: with TP x PP a rank can
                # wait for the dead one inside a kernel forever, so check them all.
                results.append(worker.result(WorkerDiedError, while_waiting=self.check_health))
            except WorkerDiedError:
                raise
            except RuntimeError as error:
                errors.append(error)
        return results, errors

    def check_health(self) -> None:
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            raise WorkerDiedError(", ".join(f"worker rank {w.rank} (pid {w.process.pid}) died with exit code "
                                            f"{w.process.exitcode}" for w in dead)
                                  + "; the engine cannot continue without it.")

    def shutdown(self) -> None:
        # Every rank leaves its process groups at the same time: NCCL tears a communicator down
        # together with its peers, so a driver that waited for the workers to exit first (or
        # left after they were gone) could wait forever. Ask, leave, then wait.
        if self.watchdog is not None:
            self.watchdog.engine_shutting_down()  # workers that stop from now on have not died
        for worker in self.workers:
            worker.request_stop()
        if self.driver_worker is not None:
            self.driver_worker.shutdown()
            self.driver_worker = None
        for worker in self.workers:
            worker.stop()
        self.workers = []
