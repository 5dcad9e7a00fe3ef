"""Several batches in a pipeline at once: vLLM v0's virtual engines, over the `mp` executor.

With pipeline parallelism and one batch in flight, stage s idles while the other stages work
(the bubble). vLLM v0 runs `pp` "virtual engines": `pp` schedulers, each with its own
requests and its own share of the KV blocks, stepped concurrently, so stage 0 starts virtual
engine 1's batch while stage 1 still runs virtual engine 0's.

    VirtualEngineExecutor(shared, v)   what virtual engine v's `LLMEngine` sees: an executor
                                       with 1/pp of the blocks and its own KV caches on every
                                       worker (`minivllm/worker/virtual_engine.py`)
    PipelinedCalls                     lets those engines call the workers from their own
                                       threads with calls overlapping, yet every rank sees the
                                       calls in one order: a call is sent to the workers and
                                       run on the driver (stage 0) under one lock, and the
                                       results are collected in the order the calls started

The engine side is `minivllm/engine/pipeline_parallel_engine.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from minivllm.config import EngineConfig
from minivllm.executor.executor_base import ExecutorBase
from minivllm.executor.multiproc_executor import MultiprocessingDistributedExecutor
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.virtual_engine import execute_virtual, initialize_virtual_caches


class PipelinedCalls:
    """Overlapping calls to one `mp` executor from several threads.

    The workers answer in the order calls reach them (each has one task queue), so calls are
    numbered when they start and collected in that order."""

    def __init__(self, executor: MultiprocessingDistributedExecutor) -> None:
        self.executor = executor
        self._start_lock = threading.Lock()
        self._turn = threading.Condition()
        self._next_ticket = self._serving = 0

    def run(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        with self._start_lock:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            try:
                driver_result, error = self.executor._start_call(method, args), None
            except BaseException as raised:  # the turn must still pass on
                driver_result, error = None, raised
        with self._turn:
            self._turn.wait_for(lambda: self._serving == ticket)
            try:
                if error is not None:
                    raise error
                return self.executor._finish_call(driver_result)
            finally:
                self._serving += 1
                self._turn.notify_all()


class SharedPipeline:
    """The one executor and the block counts its virtual engines share."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.num_virtual_engines = engine_config.parallel_config.pipeline_parallel_size
        self.executor = MultiprocessingDistributedExecutor(engine_config)
        self.calls = PipelinedCalls(self.executor)
        gpu, cpu = self.executor.determine_num_available_blocks()
        # Each virtual engine gets an equal share of what fits (vLLM divides the same way).
        self.blocks_per_engine = (gpu // self.num_virtual_engines, cpu // self.num_virtual_engines)
        if self.blocks_per_engine[0] < 1:
            raise ValueError(f"{gpu} KV blocks cannot be shared by {self.num_virtual_engines} virtual engines.")
        self._caches_ready = False

    def initialize_caches(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if not self._caches_ready:  # the first virtual engine allocates everyone's
            self.executor._run_workers(initialize_virtual_caches, num_gpu_blocks, num_cpu_blocks,
                                       self.num_virtual_engines)
            self._caches_ready = True

    def shutdown(self) -> None:
        self.executor.shutdown()


class VirtualEngineExecutor(ExecutorBase):
    """Virtual engine `virtual_engine`'s executor: the shared workers, its own caches."""

    def __init__(self, shared: SharedPipeline, virtual_engine: int, engine_config: EngineConfig) -> None:
        self.shared, self.virtual_engine = shared, virtual_engine
        super().__init__(engine_config)

    def _init_executor(self) -> None:
        """Nothing to start: the shared executor's workers are running."""

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.shared.blocks_per_engine

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.shared.initialize_caches(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        results = self.shared.calls.run(execute_virtual, self.virtual_engine, execute_model_req)
        return results[self.engine_config.parallel_config.output_rank]

    def check_health(self) -> None:
        self.shared.executor.check_health()
