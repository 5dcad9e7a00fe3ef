"""Pipeline-parallel pieces of a model (vLLM's `vllm/model_executor/models/utils.py` and the
`IntermediateTensors` of `vllm/sequence.py`, which here must stay torch-free)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import get_pp_indices
from minivllm.distributed import get_pp_group


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the residual stream after its last layer.

    tensors: {"hidden_states": [num_tokens, hidden], "residual": [num_tokens, hidden]}.
    """

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class PPMissingLayer(nn.Identity):
    """Stands where a layer of another pipeline stage would be: no weights, keeps the indices
    of the layers (and the checkpoint's names) the same on every stage."""


def missing_layer_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Names of the modules that live on other stages ("model.layers.0.", ...)."""
    return tuple(name + "." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))


def make_layers(num_layers: int, layer_fn: Callable[[], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """(start_layer, end_layer, layers): this pipeline stage's layers built by `layer_fn`, the
    others `PPMissingLayer`s, so every stage indexes layers as the checkpoint names them."""
    pp_group = get_pp_group()
    start, end = get_pp_indices(num_layers, pp_group.rank_in_group, pp_group.world_size)
    layers = nn.ModuleList(layer_fn() if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers
