"""The parallel layers split exactly: summing (or concatenating) what every TP rank computes
gives the unsplit layer's output.

The ranks are simulated in one process: each rank's layer is built under a stand-in TP group
(`FakeGroup`) that records what would be all-reduced or gathered instead of communicating,
and the test does the reduction itself. The real collectives run in
test_parallel_parity.py (gloo, several processes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.config import get_pp_indices
from minivllm.distributed import parallel_state
from minivllm.distributed.parallel_state import GroupCoordinator
from minivllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
from minivllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class FakeGroup(GroupCoordinator):
    """Rank `rank` of a TP group of `world_size`: collectives return this rank's part."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(list(range(world_size)), rank, None)

    def all_reduce(self, input_):
        return input_  # the partial sum; the test adds the ranks' parts

    def gather(self, input_, dst=0, dim=-1):
        return input_  # the local slice; the test concatenates


def build_on_each_rank(monkeypatch, world_size: int, make_layer):
    layers = []
    for rank in range(world_size):
        monkeypatch.setattr(parallel_state, "_TP", FakeGroup(rank, world_size))
        layers.append(make_layer())
    monkeypatch.setattr(parallel_state, "_TP", None)
    return layers


def load(layer, **tensors):
    for name, value in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, value)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_then_row_equals_the_unsplit_pair(monkeypatch, tp):
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    w1, b1, w2, b2 = torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16)
    expected = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    columns = build_on_each_rank(monkeypatch, tp, lambda: ColumnParallelLinear(16, 32))
    rows = build_on_each_rank(monkeypatch, tp, lambda: RowParallelLinear(32, 16, reduce_results=False))
    partials = []
    for column, row in zip(columns, rows):
        load(column, weight=w1, bias=b1)
        load(row, weight=w2, bias=b2)
        assert column.weight.shape == (32 // tp, 16) and row.weight.shape == (16, 32 // tp)
        # No communication between the two: the activation acts on this rank's columns only.
        partials.append(F.linear(F.gelu(column(x)), row.weight))
    torch.testing.assert_close(sum(partials) + b2, expected)


def test_row_parallel_adds_its_bias_once_on_rank_0(monkeypatch):
    """Rank 0's partial sum carries the bias, so the all-reduce's sum carries it once, whether
    the layer reduces or leaves the partial sums to the norm that follows."""
    x, w, b = torch.randn(3, 8), torch.randn(4, 8), torch.randn(4)
    for reduce_results in (True, False):
        rows = build_on_each_rank(monkeypatch, 2, lambda: RowParallelLinear(8, 4, reduce_results=reduce_results))
        outputs = []
        for rank, row in enumerate(rows):
            load(row, weight=w, bias=b)
            outputs.append(row(x[:, rank * 4 : (rank + 1) * 4]))  # the all-reduce here returns its input
        torch.testing.assert_close(outputs[0] + outputs[1], F.linear(x, w, b))


def test_one_rank_is_a_plain_linear_with_no_group():
    assert not parallel_state.model_parallel_is_initialized()
    layer = RowParallelLinear(8, 4)
    load(layer, weight=torch.randn(4, 8), bias=torch.randn(4))
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.tp_size == 1 and not torch.distributed.is_initialized()


def test_merged_column_keeps_gate_and_up_of_the_same_columns_together(monkeypatch):
    x, gate, up = torch.randn(3, 8), torch.randn(12, 8), torch.randn(12, 8)
    layers = build_on_each_rank(monkeypatch, 2, lambda: MergedColumnParallelLinear(8, [12, 12], bias=False))
    halves = []
    for layer in layers:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(x).chunk(2, dim=-1)  # what SiluAndMul splits: [gate_r, up_r]
        halves.append(F.silu(g) * u)
    torch.testing.assert_close(torch.cat(halves, dim=-1), F.silu(x @ gate.T) * (x @ up.T))


@settings(max_examples=40, deadline=None)
@given(num_kv_heads=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 4]),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_each_rank_gets_its_query_heads_and_the_kv_head_they_use(num_kv_heads, group, tp):
    """GQA: query head h uses KV head h // group. Whatever the TP size (more ranks than KV
    heads included: replication), rank r holds exactly that KV head for its query heads."""
    num_heads, head_size, hidden = num_kv_heads * group, 2, 4
    if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
        return  # the engine rejects these (tests/distributed/test_parallel_parity.py)
    # Row i of a head's block holds the head's index: easy to read back.
    q = torch.arange(num_heads).repeat_interleave(head_size)[:, None].float().expand(-1, hidden)
    kv = torch.arange(num_kv_heads).repeat_interleave(head_size)[:, None].float().expand(-1, hidden)
    with pytest.MonkeyPatch.context() as monkeypatch:
        layers = build_on_each_rank(monkeypatch, tp, lambda: QKVParallelLinear(
            hidden, head_size, num_heads, num_kv_heads, bias=False))
    seen_q = []
    for layer in layers:
        for shard, tensor in (("q", q), ("k", kv), ("v", kv)):
            layer.weight.weight_loader(layer.weight, tensor, shard)
        q_heads = layer.weight[: layer.num_heads * head_size : head_size, 0].long().tolist()
        k_heads = layer.weight[layer.num_heads * head_size :: head_size, 0].long().tolist()
        seen_q += q_heads
        k_rows = layer.num_kv_heads * head_size
        v_heads = layer.weight[layer.num_heads * head_size + k_rows :: head_size, 0].long().tolist()
        k_heads = k_heads[: layer.num_kv_heads]
        assert k_heads == v_heads == sorted({h // group for h in q_heads})  # the heads these queries use
        assert layer.num_kv_heads == max(1, num_kv_heads // tp)
    assert seen_q == list(range(num_heads))  # every query head on exactly one rank, in order


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_embedding_and_lm_head_pad_split_and_trim(monkeypatch, tp):
    vocab, hidden = 10, 4  # 10 rows over 3 ranks: padded to 12, the last rank has 2 padding rows
    table, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 3, 9, 4, 7]), torch.randn(2, hidden)
    embeddings = build_on_each_rank(monkeypatch, tp, lambda: VocabParallelEmbedding(vocab, hidden))
    heads = build_on_each_rank(monkeypatch, tp, lambda: ParallelLMHead(vocab, hidden))
    partial_sum, slices = 0, []
    for embedding, head in zip(embeddings, heads):
        load(embedding, weight=table)
        load(head, weight=table)
        partial_sum = partial_sum + embedding(ids)  # ids of other ranks' rows give zeros
        slices.append(F.linear(h, head.weight))
    torch.testing.assert_close(partial_sum, F.embedding(ids, table))
    logits = torch.cat(slices, dim=-1)
    assert logits.shape[-1] == -(-vocab // tp) * tp
    torch.testing.assert_close(logits[:, :vocab], h @ table.T)
    assert torch.all(logits[:, vocab:] == 0)  # padding rows are zero (and trimmed by the head)


@given(num_layers=st.integers(1, 64), pp=st.integers(1, 8))
def test_pipeline_stages_cover_every_layer_once_and_evenly(num_layers, pp):
    if pp > num_layers:
        return
    ranges = [get_pp_indices(num_layers, rank, pp) for rank in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # contiguous
    sizes = [end - start for start, end in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_fusion_moves_each_row_parallel_all_reduce_into_the_norm_after_it(monkeypatch):
    """TP=2 on symmetric memory: o_proj and down_proj leave partial sums, and exactly the norms
    that follow them (each layer's post-attention norm, the input norm of every layer but the
    first, the final norm) become AllReduceRMSNorms holding the loaded weights. Without
    symmetric memory (CPUs, NCCL only), with one rank or with a lab's own layers nothing moves."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from minivllm.model_executor.all_reduce_fusion import AllReduceRMSNorm, fuse_all_reduce_into_norms
    from minivllm.model_executor.models.llama import LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, vocab_size=64)
    group = FakeGroup(0, 2)
    monkeypatch.setattr(parallel_state, "_TP", group)
    assert fuse_all_reduce_into_norms(LlamaForCausalLM(config)) == 0  # no symmetric memory
    group.symm_mem = SimpleNamespace(disabled=False)  # stands in for a GPU group's
    lab_model = LlamaForCausalLM(config)
    lab_model.model.layers[1].mlp.down_proj.__class__ = type("LabRowParallelLinear", (RowParallelLinear,), {})
    assert fuse_all_reduce_into_norms(lab_model) == 0
    model = LlamaForCausalLM(config)
    weights = {name: p for name, p in model.named_parameters() if "norm" in name}
    assert fuse_all_reduce_into_norms(model) == 2 * config.num_hidden_layers
    layers = model.model.layers
    assert not any(layer.self_attn.o_proj.reduce_results or layer.mlp.down_proj.reduce_results for layer in layers)
    reducing = sorted(name for name, m in model.named_modules() if isinstance(m, AllReduceRMSNorm))
    assert reducing == sorted(["model.norm"] + [f"model.layers.{i}.post_attention_layernorm" for i in range(3)]
                              + [f"model.layers.{i}.input_layernorm" for i in (1, 2)])
    assert type(layers[0].input_layernorm) is not AllReduceRMSNorm and model.model.embed_tokens.tp_size == 2
    assert all(p is weights[name] for name, p in model.named_parameters() if "norm" in name)
    monkeypatch.setattr(parallel_state, "_TP", None)
    assert fuse_all_reduce_into_norms(LlamaForCausalLM(config)) == 0  # one rank: nothing to move
