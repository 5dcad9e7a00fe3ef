"""The single-process executor: one `Worker` in this process, called directly.

Mirrors vLLM v0's `GPUExecutor` / `UniProcExecutor`.
"""

from __future__ import annotations

from minivllm.executor.executor_base import ExecutorBase
from minivllm.sequence import ExecuteModelRequest, SequenceGroupOutput
from minivllm.worker.worker import Worker


class UniProcExecutor(ExecutorBase):
    """Forwards every call to one in-process worker."""

    def _init_executor(self) -> None:
        self.driver_worker = Worker(
            self.model_config,
            self.cache_config,
            self.scheduler_config,
            self.device_config,
            attn_backend=self.attn_backend,
            enforce_eager=self.enforce_eager,
        )
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.driver_worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[list[SequenceGroupOutput]]:
        return self.driver_worker.execute_model(execute_model_req)
