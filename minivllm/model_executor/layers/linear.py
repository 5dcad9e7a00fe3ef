"""Linear layers split over tensor-parallel ranks (vLLM's `vllm/model_executor/layers/linear.py`).

Megatron-LM's pairing, which a transformer layer uses twice (attention: qkv then o; MLP:
gate_up then down):

    ColumnParallelLinear   W split by OUTPUT rows:  rank r computes y_r = x @ W_r^T, its own
                           slice of the output features (its heads, its MLP columns). x is
                           the full input, already on every rank. No communication.
    RowParallelLinear      W split by INPUT columns: rank r gets the slice x_r that the column
                           layer left on it and computes a partial sum x_r @ W_r^T; the full
                           output is the sum over ranks: ONE all-reduce.

So between the two, everything (attention per head, SiLU-and-mul per column) stays local,
and each pair costs one all-reduce of `[num_tokens, hidden]`: two per decoder layer.

    x [T, H] --column--> [T, out/tp] on each rank --local op--> --row--> partial [T, H]
                                                                   --all-reduce--> [T, H]

Each weight carries a `weight_loader` that copies its rank's slice out of the full
checkpoint tensor. With one rank every layer is one `F.linear`: no copy, no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from minivllm.model_executor.weight_utils import check_shape, set_weight_loader


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W `[output_size, input_size]` split along its output rows.

    Args:
        input_size, output_size: the full (unsplit) layer's sizes.
        bias: a bias, split with its rows.
        gather_output: all-gather the slices so every rank gets the whole `[.., output_size]`
            (False in a transformer: a RowParallelLinear consumes the slices).

    Shapes: x `[num_tokens, input_size]` -> `[num_tokens, output_size / tp]` (or
    `[num_tokens, output_size]` with gather_output).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.input_size, self.output_size = input_size, output_size
        self.in_features = input_size
        self.out_features = divide(output_size, self.tp_size)  # this rank's rows
        self.gather_output = gather_output
        self.weight = set_weight_loader(nn.Parameter(torch.empty(self.out_features, input_size), requires_grad=False),
                                        self.weight_loader)
        self.bias = None
        if bias:
            self.bias = set_weight_loader(nn.Parameter(torch.empty(self.out_features), requires_grad=False),
                                          self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows: rows [rank * out/tp, (rank + 1) * out/tp) of the full tensor."""
        check_shape(loaded_weight.shape[:1], (self.output_size,))
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            output = tensor_model_parallel_all_gather(output, dim=-1)
        return output

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with the same input in one matmul (gate and up).

    `output_sizes` are the full parts, e.g. [intermediate, intermediate]. Each part is split
    over the ranks on its own, so rank r holds [gate_r, up_r] back to back and SiLU-and-mul
    pairs the right columns without any communication. A checkpoint's separate `gate_proj`
    / `up_proj` land in it by shard id (0, 1: vLLM's ids).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, gather_output)
        local_sizes = [divide(size, self.tp_size) for size in output_sizes]
        # shard id -> (first row, rows) inside this rank's weight.
        self.shard_offsets = {i: (sum(local_sizes[:i]), size) for i, size in enumerate(local_sizes)}

    @property
    def shard_ids(self) -> list:
        return list(self.shard_offsets)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("a merged layer loads its parts one at a time: give a shard id.")
        offset, size = self.shard_offsets[shard_id]
        full = self._full_size(shard_id)
        if loaded_weight.shape[0] != full:
            raise ValueError(f"shard {shard_id!r} has shape {tuple(loaded_weight.shape)}, expected "
                             f"({full}, ...) (rows of the whole checkpoint tensor).")
        param.data[offset : offset + size].copy_(loaded_weight.narrow(0, self._source_index(shard_id) * size, size))

    def _full_size(self, shard_id) -> int:
        return self.output_sizes[shard_id]

    def _source_index(self, shard_id) -> int:
        """Which slice of the checkpoint tensor this rank takes."""
        return self.tp_rank


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one column-parallel matmul, split by heads.

    Rank r gets query heads [r * H/tp, (r + 1) * H/tp) and their KV heads. With more ranks
    than KV heads (tp > num_kv_heads) each KV head cannot be split further: it is
    REPLICATED on tp / num_kv_heads consecutive ranks, exactly the ranks whose query heads
    use it (GQA groups query heads by consecutive index). KV-cache memory per rank then stops
    shrinking: this is why the number of KV heads limits useful TP.

    Shards: "q", "k", "v" (vLLM's ids).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(total_num_kv_heads, tp_size), 1
        # Full sizes as if every rank's share were distinct (replicas counted once per rank).
        q, kv = self.num_heads * head_size * tp_size, self.num_kv_heads * head_size * tp_size
        super().__init__(hidden_size, [q, kv, kv], bias)
        local = self.num_heads * head_size, self.num_kv_heads * head_size
        self.shard_offsets = {"q": (0, local[0]), "k": (local[0], local[1]), "v": (local[0] + local[1], local[1])}

    def _full_size(self, shard_id) -> int:
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        return heads * self.head_size

    def _source_index(self, shard_id) -> int:
        return self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W `[output_size, input_size]` split along its input columns.

    Args:
        input_size, output_size: the full layer's sizes.
        bias: added once, after the all-reduce (each rank adding it would count it tp times).
        reduce_results: all-reduce the partial sums (True in a transformer).

    Shapes: x `[num_tokens, input_size / tp]` (this rank's slice, as a column-parallel layer
    left it) -> `[num_tokens, output_size]`, identical on every rank.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.input_size, self.output_size = input_size, output_size
        self.in_features = divide(input_size, self.tp_size)  # this rank's columns
        self.out_features = output_size
        self.reduce_results = reduce_results
        self.weight = set_weight_loader(nn.Parameter(torch.empty(output_size, self.in_features), requires_grad=False),
                                        self.weight_loader)
        self.bias = None
        if bias:
            self.bias = set_weight_loader(nn.Parameter(torch.empty(output_size), requires_grad=False),
                                          self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Weight: this rank's columns; bias: whole (it is added after the reduction)."""
        if param.ndim == 1:
            check_shape(loaded_weight.shape, param.shape)
            param.data.copy_(loaded_weight)
            return
        check_shape(loaded_weight.shape, (self.output_size, self.input_size))
        size = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        output = F.linear(x, self.weight)  # this rank's partial sum
        if self.reduce_results:
            output = tensor_model_parallel_all_reduce(output)
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        return (f"input_features={self.in_features}, output_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}, reduce_results={self.reduce_results}")
