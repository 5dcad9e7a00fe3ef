"""The executor: the engine's one door to its worker(s) (`vllm/executor/executor_base.py`, v0).

`UniProcExecutor` calls one in-process worker; the distributed executors (`mp`, `ray`) call every
rank and return the output rank's result. `get_executor_class` picks one from the config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from minivllm.config import EngineConfig
from minivllm.sequence import ExecuteModelRequest, SamplerOutput


class ExecutorBase(ABC):
    """What the engine needs from the workers, however many there are and wherever they run."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Create the worker(s), initialise their devices and load the model."""

    @abstractmethod
    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(num_gpu_blocks, num_cpu_blocks); with several workers, the minimum over them."""

    @abstractmethod
    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the KV caches on every worker (all with the same block counts)."""

    @abstractmethod
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        """One `SamplerOutput` per model step, in order; a multi-step run may yield each as it
        reaches the host, so the engine processes step s while the device computes s + 1."""

    def start_profile(self, trace_dir: str) -> None:
        """Every worker starts torch.profiler; `stop_profile` returns their traces in rank order."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile its workers.")

    def stop_profile(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} cannot profile its workers.")

    def check_health(self) -> None:
        """Raise if a worker died (a single in-process worker cannot die on its own)."""

    def shutdown(self) -> None:
        """Release the workers."""
