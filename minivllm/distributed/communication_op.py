"""The collectives the parallel layers call, on this rank's tensor-parallel group.

Mirrors `vllm/distributed/communication_op.py`. With one TP rank each returns its input
untouched (no copy, no communication).
"""

from __future__ import annotations

import torch

from minivllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum the partial results of every TP rank (RowParallelLinear, VocabParallelEmbedding, or
    the norm after a row-parallel layer): the sum, in place or a new tensor."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's slice along `dim` (ColumnParallelLinear, gather_output=True)."""
    return get_tp_group().all_gather(input_, dim)


def tensor_model_parallel_gather(input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """Concatenate along `dim` on TP rank `dst` only (the logits, for the rank that samples)."""
    return get_tp_group().gather(input_, dst, dim)


def tensor_model_parallel_broadcast(input_: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Every TP rank gets TP rank `src`'s `input_`, in place (a multi-step run's sampled tokens)."""
    return get_tp_group().broadcast(input_, src)
