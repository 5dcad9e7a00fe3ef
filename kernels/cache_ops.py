"""Block copy (copy-on-write) and block swap (GPU <-> CPU) for the paged KV cache.

copy_blocks: when a forked sequence (parallel sampling, beam search) is about to write into a
block it still shares, the block manager gives it a fresh block and asks for a copy of the
shared one: `(src, dst)` pairs. A copy is keys and values of every layer. The Triton kernel
copies one (pair, K-or-V) block per program, in chunks; one launch per layer.

swap_blocks: preemption by swapping moves blocks between the GPU pool and a CPU pool. That is a
job for the DMA engines, not for a kernel: each block is one contiguous chunk in both pools,
so we issue one asynchronous copy per block (`copy_(..., non_blocking=True)`), which overlaps
with the host only when the CPU pool is in pinned (page-locked) memory, as the CacheEngine
allocates it. No Triton kernel can read CPU memory anyway.

Shapes: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] per layer;
block_mapping [num_pairs, 2] int64 rows of (src_block, dst_block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_CHUNK = 1024  # elements moved per loop iteration of a program


@triton.jit
def _copy_blocks_kernel(
    kv_cache_ptr, block_mapping_ptr,
    stride_kv, stride_block,  # of the [2, num_blocks, ...] cache; a block is contiguous
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    kv = tl.program_id(1)  # 0 = keys, 1 = values
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    src_ptr = kv_cache_ptr + kv * stride_kv + src * stride_block  # int64 offsets
    dst_ptr = kv_cache_ptr + kv * stride_kv + dst * stride_block
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _check_mapping(block_mapping: torch.Tensor) -> None:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}")


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy whole blocks (keys and values) `src -> dst` in every layer's cache, in place."""
    _check_mapping(block_mapping)
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.to(torch.int64).contiguous()
    for kv_cache in kv_caches:
        if kv_cache.dim() != 5 or not kv_cache.is_contiguous():
            raise ValueError("each kv_cache must be a contiguous "
                             "[2, num_blocks, block_size, num_kv_heads, head_dim] tensor")
        block_numel = kv_cache[0, 0].numel()
        _copy_blocks_kernel[(mapping.shape[0], 2)](
            kv_cache, mapping, kv_cache.stride(0), kv_cache.stride(1),
            BLOCK_NUMEL=block_numel, CHUNK=min(COPY_CHUNK, triton.next_power_of_2(block_numel)),
        )


def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks of one layer from one pool to another (`src` and `dst` may be on GPU or CPU).

    Asynchronous on CUDA: the copies are queued on the current stream, so kernels that later
    read the swapped-in blocks, or reuse the swapped-out ones, are ordered after them.
    """
    _check_mapping(block_mapping)
    if src_kv_cache.shape[2:] != dst_kv_cache.shape[2:]:
        raise ValueError("src and dst caches must have the same block shape")
    # The mapping is small host data chosen by the scheduler: reading it is not a device sync
    # when it lives on the CPU, which is where the worker keeps it.
    for src_block, dst_block in block_mapping.tolist():
        for kv in range(2):  # keys, values: each block is one contiguous chunk in both pools
            dst_kv_cache[kv, dst_block].copy_(src_kv_cache[kv, src_block], non_blocking=True)
