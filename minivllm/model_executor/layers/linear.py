"""Linear layers split over tensor-parallel ranks (vLLM's `vllm/model_executor/layers/linear.py`).

    ColumnParallelLinear   W `[out, in]` split by output rows: rank r computes its slice of the
                           output features (its heads, its MLP columns); no communication.
    RowParallelLinear      W split by input columns: rank r multiplies the slice a column layer
                           left on it; one all-reduce sums the ranks' partial outputs.

Each weight's `weight_loader` copies its rank's slice of the checkpoint tensor; the multiply
itself is the layer's `quant_method`, with one rank the whole layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import (divide, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce)
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.weight_utils import check_shape, loaded_parameter


class UnquantizedLinearMethod(CustomOp):
    """How a layer multiplies (vLLM's name): x `[num_tokens, in]` -> x @ W.T + b. On "triton"
    one bf16/fp16 token on a GPU (batch-1 decode) takes `kernels/gemv.py`, which reads W about
    twice as fast as cuBLAS there: cuBLAS tiles for many rows."""

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def forward_triton(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        one_token = x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and weight.stride(1) == 1
        if not (one_token and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
            return F.linear(x, weight, bias)
        from minivllm.kernels.gemv import gemv  # imports triton: only when this backend is chosen

        return gemv(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """x `[num_tokens, input_size]` -> `[num_tokens, output_size / tp]`, W and bias split by
    rows (sizes are the whole layer's); gather_output: all-gather to `[.., output_size]`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 backend: str = "torch") -> None:
        super().__init__()
        self.quant_method = UnquantizedLinearMethod(backend)
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.input_size, self.output_size = input_size, output_size
        self.in_features = input_size
        self.out_features = divide(output_size, self.tp_size)  # this rank's rows
        self.gather_output = gather_output
        self.weight = loaded_parameter(self.out_features, input_size, weight_loader=self.weight_loader)
        self.bias = loaded_parameter(self.out_features, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows: rows [rank * out/tp, (rank + 1) * out/tp) of the full tensor."""
        check_shape(loaded_weight.shape[:1], (self.output_size,))
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.quant_method(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            output = tensor_model_parallel_all_gather(output, dim=-1)
        return output

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel layers of one input in one matmul: `output_sizes` [gate, up], shard ids
    0, 1. Each part is split on its own, so rank r holds [gate_r, up_r] back to back."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, backend: str = "torch") -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, gather_output, backend)
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
    """q, k and v in one column-parallel matmul, split by heads; shard ids "q", "k", "v".
    With tp > num_kv_heads each KV head is replicated on the tp / num_kv_heads consecutive
    ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True, backend: str = "torch") -> None:
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
        super().__init__(hidden_size, [q, kv, kv], bias, backend=backend)
        self.shard_offsets = dict(zip("qkv", self.shard_offsets.values()))  # the parts 0, 1, 2 renamed

    def _full_size(self, shard_id) -> int:
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        return heads * self.head_size

    def _source_index(self, shard_id) -> int:
        return self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas


class RowParallelLinear(nn.Module):
    """x `[num_tokens, input_size / tp]` -> `[num_tokens, output_size]`, W split by columns;
    reduce_results=False leaves the partial sums to the caller (`all_reduce_fusion.py`)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True,
                 backend: str = "torch") -> None:
        super().__init__()
        self.quant_method = UnquantizedLinearMethod(backend)
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.input_size, self.output_size = input_size, output_size
        self.in_features = divide(input_size, self.tp_size)  # this rank's columns
        self.out_features = output_size
        self.reduce_results = reduce_results
        self.weight = loaded_parameter(output_size, self.in_features, weight_loader=self.weight_loader)
        self.bias = loaded_parameter(output_size, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Weight: this rank's columns; bias: whole (rank 0 adds it once)."""
        if param.ndim == 1:
            check_shape(loaded_weight.shape, param.shape)
            param.data.copy_(loaded_weight)
            return
        check_shape(loaded_weight.shape, (self.output_size, self.input_size))
        size = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # This rank's partial sum; rank 0's carries the bias, so the sum carries it once.
        output = self.quant_method(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return output

    def extra_repr(self) -> str:
        return (f"input_features={self.in_features}, output_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}, reduce_results={self.reduce_results}")
