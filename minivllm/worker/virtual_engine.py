"""A worker's side of pipeline virtual engines (vLLM v0: `Worker.cache_engine[virtual_engine]`).

With `pp` virtual engines each has its own scheduler and its own block numbers, so every
worker keeps one KV cache per virtual engine and runs each call on the one it names. These
two functions are sent to every rank's `PipelineStageWorker` by the executor
(`_run_workers(fn, *args)` runs `fn(worker, *args)` on every rank), so the worker classes
need no virtual-engine mode of their own.
"""

from __future__ import annotations

from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.worker import Worker


def initialize_virtual_caches(worker: Worker, num_gpu_blocks: int, num_cpu_blocks: int,
                              num_virtual_engines: int) -> None:
    """One KV cache (a GPU pool and a swap pool of the given sizes) per virtual engine."""
    caches = []
    for _ in range(num_virtual_engines):
        worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        caches.append(worker.cache_engine)
    worker.virtual_cache_engines = caches


def execute_virtual(worker: Worker, virtual_engine: int, request: ExecuteModelRequest) -> list[SamplerOutput]:
    """`Worker.execute_model` on virtual engine `virtual_engine`'s cache."""
    worker.cache_engine = worker.virtual_cache_engines[virtual_engine]
    return worker.execute_model(request)
