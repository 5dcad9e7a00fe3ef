"""Pipeline-parallel pieces of a model (vLLM's `vllm/model_executor/models/utils.py` and the
`IntermediateTensors` of `vllm/sequence.py`, which here must stay torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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
