"""PyTorch references of the two multi-LoRA ops: the spec the Triton kernels (`lora_ops.py`)
must match, and the "torch" backend's implementation.

The idea is punica's (Chen et al., 2023, "Punica: Multi-Tenant LoRA Serving"): a batch
mixes requests of different adapters, and each row must be multiplied by ITS adapter's
matrices. With every adapter's A and B stacked into one tensor per layer (a "slot" each),
one launch applies them all:

    shrink   buf[t, :] += x[t, :] @ lora_a[slot(t)].T        [T, K] -> [T, R]   (K -> rank)
    expand   y[t, n0:n0+N] += buf[t, :] @ lora_b[slot(t)].T  [T, R] -> [T, N]   (rank -> out)

so W x + B (A x) costs two skinny matmuls per row instead of a second full-size weight.
`slot(t) = -1` means no adapter (the base model): the row is left alone. The scaling
(lora_alpha / r) is folded into B when an adapter is loaded, so neither op takes it.

Shapes: x `[T, K]` (model dtype); lora_a `[L, R, K]`; lora_b `[L, N, R]` (L slots, R the
largest rank: a smaller adapter is zero-padded); buf `[T, R]` fp32; y `[T, >= n0 + N]`.
`LoRAMapping` carries `token_lora_indices` `[T]` (slot per row) and the same grouped by slot,
which the kernels use (the reference reads only `token_lora_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_LORA = -1  # slot index of a row that runs the base model


@dataclass
class LoRAMapping:
    """Which slot each row uses, in two forms.

    token_lora_indices `[T]` int32: the slot of row t, or -1.
    sorted_token_ids `[T]` int32: row indices grouped by slot (rows of slot s are
        sorted_token_ids[slot_start[s] : slot_start[s] + num_tokens_per_slot[s]]).
    num_tokens_per_slot, slot_start `[L]` int32.

    Example (L = 2): token_lora_indices [1, -1, 0, 1] -> sorted_token_ids [1, 2, 0, 3],
    num_tokens_per_slot [1, 2], slot_start [1, 2].
    """

    token_lora_indices: torch.Tensor
    sorted_token_ids: torch.Tensor
    num_tokens_per_slot: torch.Tensor
    slot_start: torch.Tensor

    @classmethod
    def build(cls, token_lora_indices: torch.Tensor, num_slots: int) -> LoRAMapping:
        """From `[T]` slot indices (on any device; every result on the same one)."""
        idx = token_lora_indices.to(torch.int64)
        slots = torch.arange(num_slots, device=idx.device)
        # A stable sort keeps rows of one slot in batch order; -1 rows come first and are skipped.
        sorted_ids = torch.sort(idx, stable=True).indices
        return cls(idx.to(torch.int32), sorted_ids.to(torch.int32),
                   (idx[None, :] == slots[:, None]).sum(1).to(torch.int32),
                   (idx[None, :] < slots[:, None]).sum(1).to(torch.int32))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, buf: torch.Tensor, mapping: LoRAMapping) -> None:
    """buf[t] += x[t] @ lora_a[slot(t)].T for every row with a slot (others untouched), in place.
    (Callers pass zeros; adding lets the kernel sum split-K partials into it.)"""
    idx = mapping.token_lora_indices[: x.shape[0]]
    delta = torch.zeros_like(buf)
    for slot in range(lora_a.shape[0]):
        rows = (idx == slot)[:, None]  # a mask, not a gather: no host sync on a GPU
        delta = torch.where(rows, x.float() @ lora_a[slot].float().T, delta)  # [T, K] @ [K, R]
    buf.add_(delta)


def lora_expand(buf: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, offset: int,
                mapping: LoRAMapping) -> None:
    """y[t, offset:offset+N] += buf[t] @ lora_b[slot(t)].T for every row with a slot, in place."""
    idx = mapping.token_lora_indices[: buf.shape[0]]
    n = lora_b.shape[1]
    delta = torch.zeros(buf.shape[0], n, dtype=torch.float32, device=buf.device)
    for slot in range(lora_b.shape[0]):
        rows = (idx == slot)[:, None]
        delta = torch.where(rows, buf @ lora_b[slot].float().T, delta)  # [T, R] @ [R, N]
    out = y[:, offset : offset + n]
    out.copy_((out.float() + delta).to(y.dtype))
