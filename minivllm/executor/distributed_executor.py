"""What every multi-worker executor shares: one call to all ranks, one result back.

Mirrors `vllm/executor/distributed_gpu_executor.py`. With tensor and pipeline parallelism
every rank must run every step, in the same order (each holds a slice of every layer, or a
stage of the stack, and they meet in collectives). So each executor call is sent to ALL
workers, and the engine gets back what the output rank returned: TP rank 0 of the last
pipeline stage, the one that gathers the logits and samples.

    determine_num_available_blocks   min over workers (the scheduler hands out one set of
                                     block numbers, which must exist on every rank)
    initialize_cache                 every worker, the same counts
    execute_model                    every worker; the output rank's result

A subclass says how to reach the workers (`_run_workers`): processes on this machine
(`mp`) or Ray actors (`ray`). Workers are called with the `Worker` method itself
(`Worker.execute_model`), not a name in a string: a typo fails where it is written; `own`
makes the call reach a `worker_cls` subclass's override of it.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from minivllm.executor.executor_base import ExecutorBase
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.worker import Worker


class WorkerDiedError(RuntimeError):
    """A worker process or actor is gone: the engine cannot go on (every rank holds part of
    the model), so this is raised to the caller rather than treated as one request's failure."""


class DistributedExecutorBase(ExecutorBase):
    """Broadcasts each call to every rank; subclasses implement `_run_workers`."""

    @abstractmethod
    def _run_workers(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """Run `method(worker, *args)` on every rank at once; the results in rank order."""

    def _init_workers(self) -> None:
        # Both steps must run on all ranks together: init_device meets the other ranks (a
        # rendezvous), load_model's parallel layers read the groups it made.
        self._run_workers(own(Worker.init_device))
        self._run_workers(own(Worker.load_model))

    def determine_num_available_blocks(self) -> tuple[int, int]:
        counts = self._run_workers(own(Worker.determine_num_available_blocks))
        return min(gpu for gpu, _ in counts), min(cpu for _, cpu in counts)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._run_workers(own(Worker.initialize_cache), num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        results = self._run_workers(run_every_step, execute_model_req)
        return results[self.engine_config.parallel_config.output_rank]

    def start_profile(self, trace_dir: str) -> None:
        self._run_workers(own(Worker.start_profile), trace_dir)

    def stop_profile(self) -> list[str]:
        return self._run_workers(own(Worker.stop_profile))


def own(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method(worker, *args)` through the worker's class: a `worker_cls` subclass's override
    of a `Worker` method runs, as vLLM's calls by name do (picklable: a partial of functions)."""
    return functools.partial(_call_own, method)


def _call_own(method: Callable[..., Any], worker: Worker, *args: Any) -> Any:
    return getattr(worker, method.__name__)(*args)


def run_every_step(worker: Worker, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
    """`worker.execute_model`, every step's output collected before returning (a result that
    can cross a process or Ray boundary). A multi-step worker queues all its steps at once
    anyway, since the ranks meet in every step's collectives; only the driver in the engine's
    process may take its outputs one by one (`MultiprocessingDistributedExecutor`)."""
    return list(worker.execute_model(execute_model_req))
