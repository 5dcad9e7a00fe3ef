"""The memory the block manager's block numbers index (vLLM's `vllm/worker/cache_engine.py`):

    gpu_cache[layer]  [2, num_gpu_blocks, block_size, num_kv_heads, head_dim]   on the device
    cpu_cache[layer]  [2, num_cpu_blocks, block_size, num_kv_heads, head_dim]   in host RAM

Index 0 holds keys, 1 values; block b, slot s holds the token whose `slot_mapping` entry is
b * block_size + s. swap_out, swap_in and copy (copy-on-write) move whole blocks.
"""

from __future__ import annotations

import torch

from minivllm.config import CacheConfig, ModelConfig, ParallelConfig
from minivllm.kernels import get_ops

# Keys and values: the leading dimension of every layer's cache tensor.
KV_PAIR = 2


class CacheEngine:
    """Allocates the per-layer KV caches and moves blocks between and within the pools.

    cache_config carries the block counts `Worker.determine_num_available_blocks` found;
    device holds the "GPU" pool (the CPU when there is no GPU); parallel_config, if given,
    sizes this rank's share (its stage's layers, its KV heads).
    """

    def __init__(self, cache_config: CacheConfig, model_config: ModelConfig, device: torch.device | str,
                 dtype: torch.dtype, attn_backend: str = "torch", parallel_config: ParallelConfig | None = None) -> None:
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
        shape = (KV_PAIR, self.num_gpu_blocks, self.block_size, self.num_kv_heads, self.head_size)
        self.gpu_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self._cpu_cache: list[torch.Tensor] | None = None

    @property
    def cpu_cache(self) -> list[torch.Tensor]:
        """The swap pool, allocated at the first swap (pinning GiBs takes seconds, and most runs
        never swap: a one-sequence group is preempted by recompute). One host buffer
        `[num_layers, 2, num_cpu_blocks, ...]`, a view per layer, pinned for asynchronous DMA:
        torch rounds each pinned allocation up to a power of two, so one buffer pins less than a
        tensor per layer would. No zeroing: a block is read only after swap_out wrote it."""
        if self._cpu_cache is None:
            shape = (self.num_layers, KV_PAIR, self.num_cpu_blocks, self.block_size, self.num_kv_heads, self.head_size)
            pool = torch.empty(shape, dtype=self.dtype, device="cpu", pin_memory=self.device.type == "cuda")
            self._cpu_cache = list(pool.unbind(0))
        return self._cpu_cache

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
        """Bytes of one block over this worker's layers:
        2 x num_layers x block_size x num_kv_heads x head_size x bytes per element."""
        element_size = torch.tensor([], dtype=dtype).element_size()
        per_token_per_layer = KV_PAIR * model_config.get_num_kv_heads(parallel_config) * model_config.get_head_size()
        return per_token_per_layer * model_config.get_num_layers(parallel_config) * block_size * element_size
