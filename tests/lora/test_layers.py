"""The LoRA layers split exactly over tensor-parallel ranks: each rank's column-parallel output
is its slice of the unsplit W x + B (A x), and the row-parallel partial sums add up to it.

Ranks are simulated in one process (as tests/distributed/test_parallel_layers.py does): a
stand-in TP group returns each rank's part from the collectives, and the test reassembles."""

from __future__ import annotations

import pytest
import torch

from minivllm.distributed import parallel_state
from minivllm.distributed.parallel_state import GroupCoordinator
from minivllm.lora.layers import (MergedColumnParallelLinearWithLoRA, QKVParallelLinearWithLoRA,
                                  RowParallelLinearWithLoRA, from_layer)
from minivllm.lora.punica_wrapper import PunicaWrapper
from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, RANK = 16, 4, 2, 4, 32, 3
SLOTS = [1, -1, 0, 1, 1]  # slot per row: 1 holds the adapter, 0 is empty, -1 is the base model


class FakeGroup(GroupCoordinator):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(list(range(world_size)), rank, None)

    def all_reduce(self, input_):
        return input_


def lora_pair(g, out_features, in_features):
    return torch.randn(RANK, in_features, generator=g), torch.randn(out_features, RANK, generator=g)


def per_rank(monkeypatch, tp, make, load, parts, x):
    """Build, load and wrap the layer on each rank, put the adapter in slot 1, run x."""
    outputs = []
    for rank in range(tp):
        monkeypatch.setattr(parallel_state, "_TP", FakeGroup(rank, tp))
        layer = make()
        load(layer)
        lora_layer = from_layer(layer)
        punica = PunicaWrapper(len(SLOTS), 2, "cpu", "torch")
        lora_layer.create_lora_weights(2, RANK + 1, punica)  # a slot wider than the adapter's rank
        lora_layer.set_lora(1, parts)
        punica.update(SLOTS)
        outputs.append((lora_layer, lora_layer(x)))
    monkeypatch.setattr(parallel_state, "_TP", None)
    return outputs


def expected(x, w, b, a, bb):
    y = x @ w.T + (b if b is not None else 0)
    delta = (x @ a.T) @ bb.T
    return y + torch.tensor([s == 1 for s in SLOTS])[:, None] * delta


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_with_lora_splits_by_heads(monkeypatch, tp):
    g = torch.Generator().manual_seed(tp)
    x = torch.randn(len(SLOTS), HIDDEN, generator=g)
    sizes = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    w = {s: torch.randn(n, HIDDEN, generator=g) for s, n in sizes.items()}
    bias = {s: torch.randn(n, generator=g) for s, n in sizes.items()}
    parts = [lora_pair(g, sizes[s], HIDDEN) for s in "qkv"]
    parts[1] = None  # an adapter without k_proj: that slice stays zero

    def load(layer):
        for s in "qkv":
            layer.weight.weight_loader(layer.weight, w[s], s)
            layer.bias.weight_loader(layer.bias, bias[s], s)

    for layer, y in per_rank(monkeypatch, tp, lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True),
                             load, parts, x):
        assert isinstance(layer, QKVParallelLinearWithLoRA)
        base = layer.base_layer
        columns = []
        for index, s in enumerate("qkv"):
            rows, start = layer.output_slices()[index]
            a, b = parts[index] if parts[index] is not None else (torch.zeros(RANK, HIDDEN), torch.zeros(sizes[s], RANK))
            full = expected(x, w[s], bias[s], a, b)
            assert start == base._source_index(s) * rows
            columns.append(full[:, start : start + rows])
        torch.testing.assert_close(y, torch.cat(columns, 1))


@pytest.mark.parametrize("tp", [1, 2])
def test_gate_up_then_down_with_lora(monkeypatch, tp):
    g = torch.Generator().manual_seed(10 + tp)
    x = torch.randn(len(SLOTS), HIDDEN, generator=g)
    w_gate, w_up = torch.randn(INTER, HIDDEN, generator=g), torch.randn(INTER, HIDDEN, generator=g)
    w_down = torch.randn(HIDDEN, INTER, generator=g)
    gate_up_parts = [lora_pair(g, INTER, HIDDEN), lora_pair(g, INTER, HIDDEN)]
    down_part = lora_pair(g, HIDDEN, INTER)

    def load_gate_up(layer):
        layer.weight.weight_loader(layer.weight, w_gate, 0)
        layer.weight.weight_loader(layer.weight, w_up, 1)

    gate_up = per_rank(monkeypatch, tp, lambda: MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False),
                       load_gate_up, gate_up_parts, x)
    full_gate = expected(x, w_gate, None, *gate_up_parts[0])
    full_up = expected(x, w_up, None, *gate_up_parts[1])
    local = INTER // tp
    total = 0
    for rank, (layer, y) in enumerate(gate_up):
        assert isinstance(layer, MergedColumnParallelLinearWithLoRA)
        cols = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(y, torch.cat([full_gate[:, cols], full_up[:, cols]], 1))
    h = torch.randn(len(SLOTS), INTER, generator=g)
    down = [None] * tp
    for rank in range(tp):  # each rank feeds its own columns of h to its row-parallel shard
        monkeypatch.setattr(parallel_state, "_TP", FakeGroup(rank, tp))
        layer = RowParallelLinear(INTER, HIDDEN, bias=False)
        layer.weight.weight_loader(layer.weight, w_down)
        lora_layer = from_layer(layer)
        punica = PunicaWrapper(len(SLOTS), 2, "cpu", "torch")
        lora_layer.create_lora_weights(2, RANK, punica)
        lora_layer.set_lora(1, [down_part])
        punica.update(SLOTS)
        down[rank] = lora_layer(h[:, rank * local : (rank + 1) * local])
        assert isinstance(lora_layer, RowParallelLinearWithLoRA)
    monkeypatch.setattr(parallel_state, "_TP", None)
    total = sum(down)  # what the all-reduce would add up
    torch.testing.assert_close(total, expected(h, w_down, None, *down_part), rtol=1e-4, atol=1e-4)
