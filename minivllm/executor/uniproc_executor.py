"""The single-process executor: one `Worker` in this process, called directly.

Mirrors vLLM v0's `GPUExecutor` / `UniProcExecutor`.
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.executor.executor_base import ExecutorBase
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.selector import worker_class


class UniProcExecutor(ExecutorBase):
    """Forwards every call to one in-process worker."""

    def _init_executor(self) -> None:
        self.driver_worker = worker_class(self.engine_config)(self.engine_config)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.driver_worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        return self.driver_worker.execute_model(execute_model_req)

    def start_profile(self, trace_dir: str) -> None:
        self.driver_worker.start_profile(trace_dir)

    def stop_profile(self) -> list[str]:
        return [self.driver_worker.stop_profile()]
