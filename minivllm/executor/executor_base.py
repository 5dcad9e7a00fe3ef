"""The executor: how the engine reaches its worker(s).

Mirrors `vllm/executor/executor_base.py` (v0). The engine never touches a `Worker`
directly; it calls these methods. With one device the executor just forwards them to
one in-process worker (`UniProcExecutor`). The distributed executors (`mp`: processes on
this machine, `ray`: Ray actors; `distributed_executor.py`) start one worker per rank,
broadcast each call to all of them (every shard runs the same step on its slice of the
heads, or its stage of the layers) and return the output rank's result — with no change
to the engine. `minivllm.executor.get_executor_class` picks one from
`distributed_executor_backend`.
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
        """Run one step (or a multi-step run): one `SamplerOutput` per model step, in order.

        A multi-step run may hand them out one at a time as they reach the host (a
        generator), so the engine processes step s while the device computes step s + 1.
        """

    def start_profile(self, trace_dir: str) -> None:
        """Every worker starts torch.profiler, for a trace in `trace_dir` (`Worker.start_profile`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile its workers.")

    def stop_profile(self) -> list[str]:
        """Every worker stops profiling: their trace files, in rank order."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile its workers.")

    def check_health(self) -> None:
        """Raise if a worker died (a single in-process worker cannot die on its own)."""

    def shutdown(self) -> None:
        """Release the workers."""
