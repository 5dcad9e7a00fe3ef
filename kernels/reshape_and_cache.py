"""reshape_and_cache in Triton: write each new token's key and value into its cache slot.

What you will learn here: the slot mapping. The scheduler gives every new token a slot,
`slot = block_number * block_size + offset_in_block`; the kernel splits it back into (block,
offset) and copies the token's `[num_kv_heads, head_dim]` key and value there. Padding tokens
carry slot -1 and are skipped. One program per token; each moves 2 * num_kv_heads * head_dim
elements, so this is a pure memory copy (the "reshape" is only the change of index).

Shapes:
    key, value          [num_tokens, num_kv_heads, head_dim]   (may be strided views of a qkv tensor)
    key/value_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping        [num_tokens] int64, -1 = skip
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,  # key
    stride_vt, stride_vh, stride_vd,  # value
    stride_cb, stride_ct, stride_ch, stride_cd,  # both caches (same strides)
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # slot -1: a padding token, nothing to store
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
        offs_d = tl.arange(0, HEAD_DIM_PAD)[None, :]  # [1, HEAD_DIM_PAD]
        mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
        key = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
        value = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
        # int64 block * stride: the cache can hold more than 2**31 elements.
        cache_offs = block * stride_cb + offset * stride_ct + offs_h * stride_ch + offs_d * stride_cd
        tl.store(key_cache_ptr + cache_offs, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + cache_offs, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into their slots, in place."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
