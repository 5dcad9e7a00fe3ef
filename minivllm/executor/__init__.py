"""Executors: how the engine reaches its worker(s) (vLLM's `vllm/executor`)."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.executor.executor_base import ExecutorBase


def get_executor_class(engine_config: EngineConfig) -> type[ExecutorBase]:
    """The executor `parallel_config.distributed_executor_backend` names (vLLM's
    `LLMEngine._get_executor_cls`): "uni" one in-process worker, "mp" processes on this
    machine, "ray" Ray actors. Imported only when chosen (Ray is optional)."""
    backend = engine_config.parallel_config.distributed_executor_backend
    if backend == "ray":
        from minivllm.executor.ray_executor import RayDistributedExecutor

        return RayDistributedExecutor
    if backend == "mp":
        from minivllm.executor.multiproc_executor import MultiprocessingDistributedExecutor

        return MultiprocessingDistributedExecutor
    from minivllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


__all__ = ["ExecutorBase", "get_executor_class"]
