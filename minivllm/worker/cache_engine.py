"""The paged KV cache itself: one tensor per layer on the device, and a CPU swap pool.

Mirrors `vllm/worker/cache_engine.py` (v0). The block manager only hands out block *numbers*;
this module owns the memory those numbers index:

    gpu_cache[layer]  [2, num_gpu_blocks, block_size, num_kv_heads, head_dim]   on the device
    cpu_cache[layer]  [2, num_cpu_blocks, block_size, num_kv_heads, head_dim]   in host RAM

Index 0 of the first dimension holds keys, 1 holds values. Block b, slot s of a layer holds
the key of the token whose `slot_mapping` entry is b * block_size + s.

The scheduler's three memory moves become tensor copies here:
    swap_out  GPU block -> CPU block (preemption by swapping)
    swap_in   CPU block -> GPU block (the preempted request resumes)
    copy      GPU block -> GPU block (copy-on-write when forked sequences diverge)
"""

from __future__ import annotations

import torch

from minivllm.config import CacheConfig, ModelConfig, ParallelConfig
from minivllm.kernels import get_ops

# Keys and values: the leading dimension of every layer's cache tensor.
KV_PAIR = 2


class CacheEngine:
    """Allocates the per-layer KV caches and moves blocks between and within the pools.

    Args:
        cache_config: block size and the block counts (`num_gpu_blocks`, `num_cpu_blocks`,
            already filled in by `Worker.determine_num_available_blocks`).
        model_config: layers, KV heads and head size.
        device: where the "GPU" pool lives (a CUDA device, or the CPU when there is no GPU).
        dtype: the cache's element type (the model's dtype).
        attn_backend: "torch" or "triton": whose `copy_blocks` / `swap_blocks` to call.
        parallel_config: with tensor / pipeline parallelism, this worker's share: its
            stage's layers and its KV heads (None: the whole model).
    """

    def __init__(
        self,
        cache_config: CacheConfig,
        model_config: ModelConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        attn_backend: str = "torch",
        parallel_config: ParallelConfig | None = None,
    ) -> None:
        if not cache_config.num_gpu_blocks:
            raise ValueError("num_gpu_blocks must be set (run the profile) before the cache exists.")
        self.block_size = cache_config.block_size
        self.num_gpu_blocks = cache_config.num_gpu_blocks
        self.num_cpu_blocks = cache_config.num_cpu_blocks or 0
        self.num_layers = model_config.get_num_layers(parallel_config)
        self.num_kv_heads = model_config.get_num_kv_heads(parallel_config)
        self.head_size = model_config.get_head_size()
        self.device = torch.device(device)
        self.dtype = dtype
        self.ops = get_ops(attn_backend)
        # Zeros: a kernel may load a whole tile of a block and mask the unused slots, and a
        # masked probability of 0 times a garbage NaN value would still be NaN.
        self.gpu_cache = self._allocate(self.num_gpu_blocks, self.device, torch.zeros)
        # The swap pool is only read after swap_out wrote it, so its pages need no zeroing
        # (and stay untouched, costing no RAM, until used). Pinned (page-locked) host memory
        # lets the GPU copy blocks by DMA, asynchronously.
        pin = self.device.type == "cuda"
        self.cpu_cache = self._allocate(self.num_cpu_blocks, torch.device("cpu"), torch.empty, pin_memory=pin)

    def _allocate(self, num_blocks: int, device: torch.device, factory, pin_memory: bool = False) -> list[torch.Tensor]:
        shape = (KV_PAIR, num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        return [
            factory(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
            for _ in range(self.num_layers)
        ]

    def swap_in(self, block_mapping: torch.Tensor) -> None:
        """Copy CPU blocks to GPU blocks. block_mapping: `[num_pairs, 2]` (cpu_block, gpu_block)."""
        for cpu_layer, gpu_layer in zip(self.cpu_cache, self.gpu_cache):
            self.ops.swap_blocks(cpu_layer, gpu_layer, block_mapping)

    def swap_out(self, block_mapping: torch.Tensor) -> None:
        """Copy GPU blocks to CPU blocks. block_mapping: `[num_pairs, 2]` (gpu_block, cpu_block)."""
        for gpu_layer, cpu_layer in zip(self.gpu_cache, self.cpu_cache):
            self.ops.swap_blocks(gpu_layer, cpu_layer, block_mapping)

    def copy(self, block_mapping: torch.Tensor) -> None:
        """Copy-on-write within the GPU pool. block_mapping: `[num_pairs, 2]` (src, dst) on device."""
        self.ops.copy_blocks(self.gpu_cache, block_mapping)

    @staticmethod
    def get_cache_block_size(block_size: int, model_config: ModelConfig, dtype: torch.dtype,
                             parallel_config: ParallelConfig | None = None) -> int:
        """Bytes one block takes across all layers (of this worker): keys and values of
        `block_size` tokens.

        = 2 x num_layers x block_size x num_kv_heads x head_size x bytes per element.
        """
        element_size = torch.tensor([], dtype=dtype).element_size()
        per_token_per_layer = KV_PAIR * model_config.get_num_kv_heads(parallel_config) * model_config.get_head_size()
        return per_token_per_layer * model_config.get_num_layers(parallel_config) * block_size * element_size
