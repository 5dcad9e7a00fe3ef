"""Copying a checkpoint tensor into a parameter (vLLM's `model_loader/weight_utils.py`).

Every parameter may carry a `weight_loader(param, loaded_weight[, shard_id])` attribute, set
by the layer that owns it: a tensor-parallel layer copies only its rank's slice of the
checkpoint tensor. Parameters without one get `default_weight_loader`: a whole copy.
"""

from __future__ import annotations

import torch
from torch import nn


def check_shape(actual: tuple[int, ...], expected: tuple[int, ...], what: str = "checkpoint") -> None:
    """ValueError unless a checkpoint tensor has the full (unsplit) shape the model expects."""
    if tuple(actual) != tuple(expected):
        raise ValueError(f"{what} shape {tuple(actual)}, model {tuple(expected)}.")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy the whole tensor (shapes must match)."""
    check_shape(loaded_weight.shape, param.shape)
    param.data.copy_(loaded_weight)


def loaded_parameter(*shape: int, weight_loader) -> nn.Parameter:
    """An uninitialized frozen `[*shape]` parameter that `weight_loader` fills."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader
    return param
