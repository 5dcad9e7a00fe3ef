"""One device's worker: owns the model (via `ModelRunner`) and the KV cache (`CacheEngine`).

Mirrors `vllm/worker/worker.py` (v0). The engine talks to it, through the executor, in
this order:

    init_device()                       pick the device, seed the RNGs, join the process groups
    load_model()                        weights onto the device
    determine_num_available_blocks()    profile the largest batch, turn leftover memory
                                        into a number of KV blocks
    initialize_cache(gpu, cpu)          allocate the caches; capture CUDA graphs
    execute_model(request)  (per step)  swap-out, swap-in, copy-on-write, then the forward

How many blocks fit, with block_bytes = `CacheEngine.get_cache_block_size`:
    CUDA  num_gpu_blocks = (total x gpu_memory_utilization - peak of `profile_run`) // block_bytes
    CPU   num_gpu_blocks = min(MINIVLLM_CPU_KVCACHE_SPACE GiB (default 0.5, at most 1/4 of RAM),
                               what max_num_seqs full-length sequences hold) // block_bytes
    both  num_cpu_blocks = min(swap_space, what max_num_seqs full-length sequences hold) // block_bytes
          (`num_gpu_blocks_override` replaces the GPU figure)

With tensor / pipeline parallelism there is one worker per rank; the executor takes the
minimum of their counts. `selector.py` picks the runner class, and the executor the worker class.
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
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.selector import model_runner_class

logger = logging.getLogger(__name__)

CPU_KVCACHE_SPACE_ENV = "MINIVLLM_CPU_KVCACHE_SPACE"
_DEFAULT_CPU_KVCACHE_SPACE_GIB = 0.5
_MAX_CPU_RAM_FRACTION = 0.25
_GiB = 1 << 30
# CPU threads: one per this many parameters. A small model's matmuls are too small to split,
# and each op's threads wait for the slowest, so extra threads only add waiting. Set
# OMP_NUM_THREADS to choose yourself.
_PARAMS_PER_CPU_THREAD = 25_000_000


class Worker:
    """Runs the model on one device and holds its KV cache.

    Args (vLLM's): engine_config; local_rank (this rank's GPU index on its machine), rank
    (global), distributed_init_method ("tcp://host:port", where the ranks meet; needed when
    the world size is above 1), is_driver_worker (the rank the engine's process holds).
    """

    def __init__(self, engine_config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:
        load_general_plugins()  # a worker process runs the plugins too (models, connectors)
        # This worker's own copy of the parallel config, carrying its rank (never written into
        # the engine's shared config).
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
        # The plain runner, or one extended by the configured modes (CUDA graphs, LoRA, ...).
        runner_class = model_runner_class(engine_config, self.device)
        self.model_runner: ModelRunner = runner_class(engine_config, self.device)
        self.cache_engine: CacheEngine | None = None
        self.profiler: torch.profiler.profile | None = None
        self.trace_dir, self.num_traces = "", 0

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
            _limit_cpu_threads(self.model_config)
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
        """(num_gpu_blocks, num_cpu_blocks) that fit; see the module docstring.

        On a GPU the peak counts everything on it (another engine, other processes), so a
        second engine on a busy GPU gets a clear error here rather than running out later."""
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
        """Apply the step's block moves, then run the model on the scheduled groups.

        Returns the step's outputs (vLLM: a list of `SamplerOutput`, one per step run; the
        multi-step worker returns several).
        """
        self.apply_block_moves(execute_model_req)
        return [self.model_runner.execute_model(execute_model_req.seq_group_metadata_list, self.kv_caches,
                                                execute_model_req.finished_requests_ids)]

    # ------------------------------------------------------------------ profiling
    def start_profile(self, trace_dir: str) -> None:
        """Record this rank's CPU ops and GPU kernels (torch.profiler) until `stop_profile`,
        which writes the trace into `trace_dir`."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler, self.trace_dir = torch.profiler.profile(activities=activities), trace_dir
        self.profiler.start()

    def stop_profile(self) -> str:
        """Stop recording and write the Chrome trace (Perfetto or chrome://tracing opens it):
        its path, `<trace_dir>/rank<rank>-<n>.pt.trace.json`."""
        if self.profiler is None:
            raise RuntimeError("stop_profile without start_profile.")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels queued inside the window finish in it
        self.profiler.stop()
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"rank{self.rank}-{self.num_traces}.pt.trace.json")
        self.profiler.export_chrome_trace(path)
        self.profiler, self.num_traces = None, self.num_traces + 1
        return path

    def shutdown(self) -> None:
        """Leave the process groups (a world of one has none)."""
        if self.parallel_config.world_size > 1:
            destroy_distributed_environment()

    @torch.inference_mode()
    def apply_block_moves(self, req: ExecuteModelRequest) -> None:
        """Swap-out, swap-in, then copy-on-write copies, as the scheduler decided."""
        # Order matters: swap-out frees GPU blocks that swap-in or copy may then reuse in
        # the same step, so it must read them first.
        if req.blocks_to_swap_out:
            self.cache_engine.swap_out(torch.tensor(req.blocks_to_swap_out, dtype=torch.long))
        if req.blocks_to_swap_in:
            self.cache_engine.swap_in(torch.tensor(req.blocks_to_swap_in, dtype=torch.long))
        if req.blocks_to_copy:
            mapping = torch.tensor(req.blocks_to_copy, dtype=torch.long, device=self.device)
            self.cache_engine.copy(mapping)


def _limit_cpu_threads(model_config) -> None:
    """Use fewer of torch's CPU threads for a small model (never more than torch already uses).

    torch.set_num_threads is process-wide; OMP_NUM_THREADS, when set, is the user's choice.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return
    cfg = model_config.hf_config
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    intermediate = getattr(cfg, "intermediate_size", 4 * hidden)
    # Embedding plus, per layer, attention (at most 4 hidden x hidden) and a gated MLP.
    num_params = cfg.vocab_size * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate)
    threads = min(torch.get_num_threads(), max(1, num_params // _PARAMS_PER_CPU_THREAD))
    if threads < torch.get_num_threads():
        logger.info("small model (~%.0fM parameters): using %d CPU thread(s)", num_params / 1e6, threads)
        torch.set_num_threads(threads)
