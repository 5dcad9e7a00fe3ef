"""One device's worker: the model (`ModelRunner`) and the KV cache (`CacheEngine`).

Mirrors `vllm/worker/worker.py` (v0). The executor calls, in order: `init_device`,
`load_model`, `determine_num_available_blocks`, `initialize_cache`, then `execute_model`
every step. Blocks that fit, with block_bytes = `CacheEngine.get_cache_block_size`:
    CUDA  num_gpu_blocks = (total x gpu_memory_utilization - peak of `profile_run`) // block_bytes
    CPU   num_gpu_blocks = min(MINIVLLM_CPU_KVCACHE_SPACE GiB (default 0.5, at most 1/4 of RAM),
                               what max_num_seqs full-length sequences hold) // block_bytes
    both  num_cpu_blocks = min(swap_space, what max_num_seqs full-length sequences hold) // block_bytes
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os

import torch

from minivllm.config import EngineConfig
from minivllm.distributed import (destroy_distributed_environment, init_distributed_environment,
                                  initialize_model_parallel, set_custom_all_reduce, wait_for_pending_teardown)
from minivllm.plugins import load_general_plugins
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.cpu_threads import limit_cpu_threads
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.selector import model_runner_class
from minivllm.worker.worker_profiler import WorkerProfilerMixin

logger = logging.getLogger(__name__)

CPU_KVCACHE_SPACE_ENV = "MINIVLLM_CPU_KVCACHE_SPACE"
_DEFAULT_CPU_KVCACHE_SPACE_GIB = 0.5
_MAX_CPU_RAM_FRACTION = 0.25
_GiB = 1 << 30


class Worker(WorkerProfilerMixin):
    """Runs the model on one device and holds its KV cache.

    Args (vLLM's): local_rank (this rank's GPU on its machine), rank (global),
    distributed_init_method ("tcp://host:port" where the ranks meet, for a world above 1),
    is_driver_worker (the rank in the engine's process).
    """

    def __init__(self, engine_config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:
        load_general_plugins()  # a worker process runs the plugins too (models, connectors)
        # This worker's own copy of the parallel config, carrying its rank.
        parallel_config = dataclasses.replace(engine_config.parallel_config, rank=rank)
        engine_config = dataclasses.replace(engine_config, parallel_config=parallel_config)
        self.engine_config = engine_config
        self.parallel_config = parallel_config
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.device = torch.device(engine_config.device_config.device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" means the current GPU; CUDA calls such as set_device need its index.
            # With several ranks each takes the GPU of its local rank.
            index = local_rank if parallel_config.world_size > 1 else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
        runner_class = model_runner_class(engine_config, self.device)  # the plain one or a mode's
        self.model_runner: ModelRunner = runner_class(engine_config, self.device)
        self.cache_engine: CacheEngine | None = None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.cache_engine.gpu_cache

    def init_device(self) -> None:
        wait_for_pending_teardown()  # an earlier engine of this process may still be leaving its NCCL world
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Hand memory freed by earlier engines (maybe still in reference cycles) back to the
            # driver, so it counts as free below.
            gc.collect()
            torch.cuda.empty_cache()
        else:
            limit_cpu_threads(self.model_config)
        # Unseeded requests draw from the global RNG: seed it so runs are repeatable.
        torch.manual_seed(self.model_config.seed)
        parallel = self.parallel_config
        if parallel.world_size > 1:
            if self.distributed_init_method is None:
                raise ValueError("a worker of a world larger than 1 needs distributed_init_method.")
            init_distributed_environment(parallel.world_size, self.rank, self.distributed_init_method,
                                         self.local_rank, backend="nccl" if self.device.type == "cuda" else "gloo")
            set_custom_all_reduce(not parallel.disable_custom_all_reduce)
            initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    def load_model(self) -> None:
        self.model_runner.load_model()

    # ------------------------------------------------------------------ memory
    def get_cache_block_size_bytes(self) -> int:
        return CacheEngine.get_cache_block_size(self.cache_config.block_size, self.model_config, self.model_runner.dtype,
                                                self.parallel_config)

    @torch.inference_mode()
    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(num_gpu_blocks, num_cpu_blocks) that fit (module docstring). The GPU peak counts
        everything on the device, so a busy GPU fails here, not later."""
        block_bytes = self.get_cache_block_size_bytes()
        if self.device.type == "cuda":
            num_gpu_blocks = self._profile_gpu_blocks(block_bytes)
        else:
            num_gpu_blocks = self._cpu_budget_blocks(block_bytes)
        if self.cache_config.num_gpu_blocks_override is not None:
            num_gpu_blocks = self.cache_config.num_gpu_blocks_override
        # More swap blocks than max_num_seqs full-length sequences hold would never be used,
        # and every block costs the (pure Python) block manager an object.
        num_cpu_blocks = min(self.cache_config.swap_space_bytes // block_bytes, self._max_blocks_in_use())
        if num_gpu_blocks < 1:
            raise ValueError(
                "no memory left for the KV cache: the weights, the profile's activations and "
                "whatever else already uses the device take all of gpu_memory_utilization; raise "
                "it, free the GPU, or lower max_num_batched_tokens / max_num_seqs."
            )
        return num_gpu_blocks, num_cpu_blocks

    def _profile_gpu_blocks(self, block_bytes: int) -> int:
        self.model_runner.profile_run()
        # The caching allocator still holds the profile's peak, so free memory is at its lowest.
        free, total = torch.cuda.mem_get_info()
        peak = total - free
        available = total * self.cache_config.gpu_memory_utilization - peak
        torch.cuda.empty_cache()
        logger.info("profile: total %.2f GiB, in use at peak %.2f GiB, %.2f GiB for the KV cache",
                    total / _GiB, peak / _GiB, available / _GiB)
        return int(available // block_bytes)

    def _cpu_budget_blocks(self, block_bytes: int) -> int:
        budget = float(os.environ.get(CPU_KVCACHE_SPACE_ENV, _DEFAULT_CPU_KVCACHE_SPACE_GIB)) * _GiB
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else budget
        budget = min(budget, ram * _MAX_CPU_RAM_FRACTION)
        return int(min(budget // block_bytes, self._max_blocks_in_use()))

    def _max_blocks_in_use(self) -> int:
        """Blocks that max_num_seqs sequences of max_model_len tokens hold at most."""
        blocks_per_seq = -(-self.scheduler_config.max_model_len // self.cache_config.block_size)
        return self.scheduler_config.max_num_seqs * blocks_per_seq

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the two pools (the config stays as built: the counts are arguments)."""
        cache_config = dataclasses.replace(self.cache_config, num_gpu_blocks=num_gpu_blocks,
                                           num_cpu_blocks=num_cpu_blocks)
        self.cache_engine = CacheEngine(cache_config, self.model_config, self.device, self.model_runner.dtype,
                                        self.model_runner.backend, self.parallel_config)
        self.model_runner.capture_model(self.cache_engine.gpu_cache)

    # ------------------------------------------------------------------ a step
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        """Apply the step's block moves, then run the model: `[SamplerOutput]` (vLLM's list,
        one per step run; the multi-step worker returns several)."""
        self.apply_block_moves(execute_model_req)
        return [self.model_runner.execute_model(execute_model_req.seq_group_metadata_list, self.kv_caches,
                                                execute_model_req.finished_requests_ids)]

    @torch.inference_mode()
    def apply_block_moves(self, req: ExecuteModelRequest) -> None:
        """Swap-out, swap-in, then copy-on-write copies, as the scheduler decided."""
        # Swap-out first: it frees GPU blocks that swap-in or copy may reuse in the same step.
        if req.blocks_to_swap_out:
            self.cache_engine.swap_out(torch.tensor(req.blocks_to_swap_out, dtype=torch.long))
        if req.blocks_to_swap_in:
            self.cache_engine.swap_in(torch.tensor(req.blocks_to_swap_in, dtype=torch.long))
        if req.blocks_to_copy:
            mapping = torch.tensor(req.blocks_to_copy, dtype=torch.long, device=self.device)
            self.cache_engine.copy(mapping)

    def shutdown(self) -> None:
        """Leave the process groups (a world of one has none)."""
        if self.parallel_config.world_size > 1:
            destroy_distributed_environment()
