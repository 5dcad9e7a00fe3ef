"""PyTorch references of the two multi-LoRA ops (punica's SGMV): the spec the Triton kernels
(`lora_ops.py`) must match, and the "torch" backend's implementation. Mirrors vLLM's
`vllm/lora/ops/sgmv_shrink.py` / `sgmv_expand.py` and their tests' references.

    shrink   h[t, :] = x[t, :] @ lora_a[slot(t)].T             [T, K] -> [T, S*R]  (K -> rank)
    expand   y[t, slice s] += h[t, s*R:(s+1)*R] @ B_s[slot(t)].T  [T, S*R] -> [T, N]  (rank -> out)

x `[T, K]` (model dtype); lora_a `[L, S*R, K]` (L slots, R the largest rank, smaller adapters
zero-padded); lora_b `[L, N, R]`, slice s in rows slice_bounds[s] : slice_bounds[s + 1]
(slice_bounds = (0, N_0, N_0 + N_1, ..., N)); y `[T, N]`. A fused projection's S slices (q,
k, v: 3; gate, up: 2; else 1) share their input: one shrink gives every slice's h, one expand
fills y. `slot(t) = -1` (`NO_LORA`) leaves the row alone; the scaling lora_alpha / r is
folded into B at load time. h is `[P, T, S*R]` fp32 whose SUM over P is the product (the
Triton shrink leaves P split-K planes; the reference returns one); rows without a slot hold
anything. The reference keeps h in fp32 where the Triton expand rounds it to B's dtype: the
same in fp32, one rounding of h apart in bf16/fp16. `LoRAMapping` carries
`token_lora_indices` `[T]` (slot per row) and the same grouped by slot for the kernels.
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


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """h `[1, T, S*R]` fp32: h[0, t] = x[t] @ lora_a[slot(t)].T for rows with a slot, 0 elsewhere."""
    idx = mapping.token_lora_indices[: x.shape[0]]
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(lora_a.shape[0]):
        rows = (idx == slot)[:, None]  # a mask, not a gather: no host sync on a GPU
        h = torch.where(rows, x.float() @ lora_a[slot].float().T, h)  # [T, K] @ [K, S*R]
    return h.unsqueeze(0)


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slice_bounds: tuple[int, ...],
                mapping: LoRAMapping) -> None:
    """y[t, slice s] += h[:, t, s*R:(s+1)*R].sum(0) @ B_s[slot(t)].T for rows with a slot, in place."""
    idx = mapping.token_lora_indices[: h.shape[1]]
    rank = lora_b.shape[2]
    hidden = h.sum(0)  # the split-K planes, added
    delta = torch.zeros(h.shape[1], lora_b.shape[1], dtype=torch.float32, device=h.device)
    for s, (lo, hi) in enumerate(zip(slice_bounds, slice_bounds[1:])):
        h_s = hidden[:, s * rank : (s + 1) * rank]
        for slot in range(lora_b.shape[0]):
            rows = (idx == slot)[:, None]
            delta[:, lo:hi] = torch.where(rows, h_s @ lora_b[slot, lo:hi].float().T, delta[:, lo:hi])  # [T, R] @ [R, N_s]
    y.copy_((y.float() + delta).to(y.dtype))
