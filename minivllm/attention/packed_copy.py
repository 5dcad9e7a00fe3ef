"""A step's small input tensors on the GPU in one copy: `to_device_together`.

A decode step's inputs (slots, sequence lengths, block tables, token ids) are a few kilobytes.
Each host-to-device copy costs the host more time to issue than its bytes take to move, and a
small-batch step is host-bound, so they travel together:

    host:    [slots int64 | seq_lens int32 + pad | block_tables int32 | ...]   one pinned buffer
    device:  the same bytes, one copy; each tensor a view of its part (16-byte aligned)

Each part starts on a 16-byte boundary because Triton compiles a kernel once per alignment
class of its pointer arguments (16-byte aligned or not): a view at 8 mod 16 would make the
next step stop mid-run to compile the kernel again.
"""

from __future__ import annotations

import itertools

import torch

ALIGN = 16  # bytes: the alignment Triton specializes pointer arguments on


def to_device_together(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors on `device`, each with its dtype and shape: one asynchronous copy on a GPU."""
    if torch.device(device).type != "cuda":
        return [t.to(device) for t in tensors]
    nbytes = [t.numel() * t.element_size() for t in tensors]
    starts = packed_starts(nbytes)
    packed = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=True)
    for t, start, n in zip(tensors, starts, nbytes):
        packed[start : start + n] = t.contiguous().view(-1).view(torch.uint8)
    on_device = packed.to(device, non_blocking=True)
    return [on_device[start : start + n].view(t.dtype).view(t.shape) for t, start, n in zip(tensors, starts, nbytes)]


def packed_starts(nbytes: list[int]) -> list[int]:
    """Byte offset of each part in the packed buffer, then its total size: each part rounded
    up to ALIGN bytes. nbytes [20, 12, 0, 8] -> [0, 32, 48, 48, 64]."""
    return list(itertools.accumulate((-(-n // ALIGN) * ALIGN for n in nbytes), initial=0))
