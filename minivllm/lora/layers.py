"""The parallel linear layers with a table of LoRA slots (vLLM's `vllm/lora/layers.py`).

Each class wraps a built, loaded layer of `model_executor/layers/linear.py` and adds, per
output slice, two stacked tensors with one row per GPU slot:

    lora_a  [max_loras, max_lora_rank, in_features (this rank's)]
    lora_b  [max_loras, out_features of the slice (this rank's), max_lora_rank]

The slices' tensors are views into two stacked ones: A into `lora_a_stacked`
`[max_loras, num_slices * max_lora_rank, in]` (the slices share their input: one shrink
reads x once for q, k and v), B into `lora_b_stacked` `[max_loras, out, max_lora_rank]` (the
slices' outputs sit side by side in y: one expand fills them all).

forward = the base layer's matmul, then `PunicaWrapper.add_lora_linear` adds each row's own
adapter. Adapters of a smaller rank fill the first r ranks of a slot; the rest stay zero.

Split over tensor-parallel ranks (Megatron's pairing, as the base layers):
    column-parallel (qkv, gate_up)  x is whole on every rank: A whole, B split by OUTPUT
                                    rows like W (each slice by its own rule: q by query
                                    heads, k/v by KV heads with their replicas)
    row-parallel (o, down)          x is this rank's input columns: A split by INPUT columns
                                    like W, B whole; the partial x_r A_r^T B^T joins the
                                    partial x_r W_r^T BEFORE the one all-reduce, whose sum
                                    over ranks is x A^T B^T: no extra communication.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from minivllm.lora.punica_wrapper import PunicaWrapper
from minivllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)


class BaseLayerWithLoRA(nn.Module):
    """A base layer plus its slots. Subclasses say how the full adapter matrices split."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.tp_size, self.tp_rank = base_layer.tp_size, base_layer.tp_rank
        self.punica: PunicaWrapper | None = None

    # Per slice: (this rank's output rows, first row of this rank in the full slice).
    def output_slices(self) -> list[tuple[int, int]]:
        return [(self.base_layer.out_features, self.tp_rank * self.base_layer.out_features)]

    def create_lora_weights(self, max_loras: int, max_rank: int, punica: PunicaWrapper) -> None:
        weight = self.base_layer.weight
        kw = dict(dtype=weight.dtype, device=weight.device)
        in_features, num_slices = weight.shape[1], len(self.output_slices())
        self.lora_a_stacked = torch.zeros(max_loras, num_slices * max_rank, in_features, **kw)
        self.lora_a = tuple(self.lora_a_stacked[:, i * max_rank : (i + 1) * max_rank] for i in range(num_slices))
        widths = [rows for rows, _ in self.output_slices()]
        self.slice_bounds = tuple(sum(widths[:i]) for i in range(num_slices + 1))  # (0, N_0, N_0 + N_1, ..., N)
        self.lora_b_stacked = torch.zeros(max_loras, self.slice_bounds[-1], max_rank, **kw)
        self.lora_b = tuple(self.lora_b_stacked[:, lo:hi] for lo, hi in zip(self.slice_bounds, self.slice_bounds[1:]))
        self.punica = punica

    def add_lora(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's own adapter applied to x, in place (every slice at once)."""
        self.punica.add_lora_linear(y, x, self.lora_a_stacked, self.lora_b_stacked, self.slice_bounds)

    def reset_lora(self, slot: int) -> None:
        for a, b in zip(self.lora_a, self.lora_b):
            a[slot].zero_()
            b[slot].zero_()

    def set_lora(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` from the adapter's FULL matrices, one (A [r, in], scaled B [out, r]) per
        slice, or None for a slice the adapter does not target (it stays zero)."""
        self.reset_lora(slot)
        for i, part in enumerate(parts):
            if part is None:
                continue
            a, b = self.slice_lora_a(part[0]), self.slice_lora_b(part[1], i)
            r = a.shape[0]
            self.lora_a[i][slot, :r].copy_(a)
            self.lora_b[i][slot, :, :r].copy_(b)

    def slice_lora_a(self, a: torch.Tensor) -> torch.Tensor:
        return a  # column-parallel: the input is whole on every rank

    def slice_lora_b(self, b: torch.Tensor, index: int) -> torch.Tensor:
        rows, start = self.output_slices()[index]
        return b[start : start + rows]


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        y = base.quant_method(x, base.weight, base.bias)
        self.add_lora(y, x)
        if base.gather_output and self.tp_size > 1:
            y = tensor_model_parallel_all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """gate_up_proj: slices gate and up, each split over the ranks on its own."""

    def output_slices(self) -> list[tuple[int, int]]:
        base = self.base_layer
        return [(base.shard_offsets[s][1], base._source_index(s) * base.shard_offsets[s][1]) for s in base.shard_ids]


class QKVParallelLinearWithLoRA(MergedColumnParallelLinearWithLoRA):
    """qkv_proj: slices q, k, v; with more ranks than KV heads a rank takes its KV head's rows,
    as the base layer does (`QKVParallelLinear._source_index`)."""


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    def output_slices(self) -> list[tuple[int, int]]:
        return [(self.base_layer.out_features, 0)]  # B is whole

    def slice_lora_a(self, a: torch.Tensor) -> torch.Tensor:
        cols = self.base_layer.in_features
        return a[:, self.tp_rank * cols : (self.tp_rank + 1) * cols]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        # This rank's partial sum (rank 0's with the bias), LoRA's partial added before the reduce.
        y = base.quant_method(x, base.weight, base.bias if self.tp_rank == 0 else None)
        self.add_lora(y, x)
        if base.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y


def from_layer(layer: nn.Module) -> BaseLayerWithLoRA:
    """The LoRA version of a parallel linear layer (most specific class first)."""
    for base_class, lora_class in ((QKVParallelLinear, QKVParallelLinearWithLoRA),
                                   (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
                                   (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
                                   (RowParallelLinear, RowParallelLinearWithLoRA)):
        if isinstance(layer, base_class):
            return lora_class(layer)
    raise ValueError(f"no LoRA layer for {type(layer).__name__}.")
