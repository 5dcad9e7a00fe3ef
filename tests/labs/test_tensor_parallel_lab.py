"""Lab 10's checks (`minivllm/labs/tensor_parallel.py`): they pass on the package's own parallel
linear layers, on two gloo ranks and inside an `mp` engine of two ranks, and fail, naming the
mistake, on layers with a missing all-reduce, a doubled bias or the wrong shard of a weight.

The layer modules are written to files: the ranks are spawned processes that import them."""

from __future__ import annotations

import importlib
import re
import textwrap

import pytest

from minivllm.labs import LabCheckFailed
from minivllm.labs.tensor_parallel import check_parallel_linears, check_tensor_parallel_engine

# The package's four classes under a module of their own, plus a worker that swaps them in;
# a variant below replaces one class by a wrong subclass.
LAYERS = """
import sys

import torch.nn.functional as F

from minivllm.distributed import get_tensor_model_parallel_rank, tensor_model_parallel_all_reduce
from minivllm.labs.tensor_parallel import replace_parallel_linears
from minivllm.model_executor.layers import linear
from minivllm.worker.worker import Worker


class ColumnParallelLinear(linear.ColumnParallelLinear):
    pass


class MergedColumnParallelLinear(linear.MergedColumnParallelLinear):
    pass


class QKVParallelLinear(linear.QKVParallelLinear):
    pass


class RowParallelLinear(linear.RowParallelLinear):
    pass


class LabWorker(Worker):
    def load_model(self):
        super().load_model()
        replace_parallel_linears(self.model_runner.model, sys.modules[__name__], self.model_config)
"""

WRONG = {
    "no_all_reduce": ("""
class RowParallelLinear(linear.RowParallelLinear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)  # the partial sums are never added
""", "all-reduce that adds the ranks' partial sums is missing"),
    "bias_on_every_rank": ("""
class RowParallelLinear(linear.RowParallelLinear):
    def forward(self, x):
        return tensor_model_parallel_all_reduce(F.linear(x, self.weight, self.bias))
""", "the bias is counted 2 times"),
    "other_ranks_rows": ("""
class ColumnParallelLinear(linear.ColumnParallelLinear):
    def weight_loader(self, param, loaded_weight):
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, (1 - self.tp_rank) * size, size))
""", "of the checkpoint's [8, 6]; it holds rank"),
    "row_split_by_rows": ("""
class RowParallelLinear(linear.RowParallelLinear):
    def weight_loader(self, param, loaded_weight):
        if param.ndim == 1:
            return param.data.copy_(loaded_weight)
        param.data.copy_(loaded_weight[:, :param.shape[1]])  # every rank keeps rank 0's columns
""", "RowParallelLinear(8, 6), rank 1 of 2: the weight should be columns 4:8"),
    "merged_split_whole": ("""
class MergedColumnParallelLinear(linear.MergedColumnParallelLinear):
    def weight_loader(self, param, loaded_weight, shard_id=None):
        offset, size = self.shard_offsets[shard_id]
        param.data[offset:offset + size].copy_(loaded_weight[:size])  # every rank takes rank 0's rows
""", "MergedColumnParallelLinear(6, [4, 8]), rank 1 of 2"),
    "kv_not_replicated": ("""
class QKVParallelLinear(linear.QKVParallelLinear):
    def _source_index(self, shard_id):
        return self.tp_rank  # with 1 KV head over 2 ranks there is no slice 1
""", "1 KV heads), rank 1 of 2"),
}


def _write_layers(tmp_path, monkeypatch, name: str, extra: str = ""):
    (tmp_path / f"{name}.py").write_text(LAYERS + textwrap.dedent(extra))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_the_package_layers_pass_on_two_ranks(tmp_path, monkeypatch, capsys):
    check_parallel_linears(_write_layers(tmp_path, monkeypatch, "lab10_reference_layers"))
    assert capsys.readouterr().out.count("✓") == 4


@pytest.mark.parametrize("mistake", sorted(WRONG))
def test_a_wrong_layer_fails_on_two_ranks_naming_the_mistake(tmp_path, monkeypatch, mistake):
    code, message = WRONG[mistake]
    layers = _write_layers(tmp_path, monkeypatch, f"lab10_wrong_{mistake}", code)
    with pytest.raises(LabCheckFailed, match=re.escape(message)):
        check_parallel_linears(layers)


def test_a_missing_class_is_named(tmp_path, monkeypatch):
    layers = _write_layers(tmp_path, monkeypatch, "lab10_missing_class", "del QKVParallelLinear\n")
    with pytest.raises(LabCheckFailed, match="has no QKVParallelLinear"):
        check_parallel_linears(layers)


def test_the_package_layers_pass_inside_a_two_rank_engine(tmp_path, monkeypatch):
    _write_layers(tmp_path, monkeypatch, "lab10_reference_engine")
    token_ids = check_tensor_parallel_engine("lab10_reference_engine:LabWorker", max_tokens=8)
    assert len(token_ids) == 4 and all(len(ids) == 8 for ids in token_ids)


def test_the_engine_check_fails_without_the_all_reduce(tmp_path, monkeypatch):
    _write_layers(tmp_path, monkeypatch, "lab10_engine_no_all_reduce", WRONG["no_all_reduce"][0])
    with pytest.raises(LabCheckFailed, match="transformers says"):
        check_tensor_parallel_engine("lab10_engine_no_all_reduce:LabWorker", max_tokens=8)


def test_the_engine_check_fails_when_the_worker_keeps_the_package_layers():
    with pytest.raises(LabCheckFailed, match="should put yours in"):
        check_tensor_parallel_engine("minivllm.worker.worker:Worker", max_tokens=8)
