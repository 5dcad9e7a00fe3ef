"""One adapter's weights (`LoRAModel`) and the model's GPU slots (`LoRAModelManager`).

vLLM's `vllm/lora/models.py`. The manager replaces every qkv/o/gate_up/down projection of a
loaded model with its LoRA version (`layers.py`), once, and then keeps up to `max_loras`
adapters in GPU slots: an adapter a batch needs is copied into a free slot, or into the
least recently used slot that this batch does not need (the scheduler guarantees that at most
`max_loras` distinct adapters share a batch, so there always is one).

Hugging Face names vs ours: an adapter targets q_proj, k_proj and v_proj separately; here they
are the three slices of the fused qkv_proj (gate_proj and up_proj: of gate_up_proj). The model
class's `stacked_params_mapping` (the weight loader's table) says which slice is which.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from minivllm.lora.layers import BaseLayerWithLoRA, from_layer
from minivllm.lora.peft_helper import WEIGHTS_FILE, PEFTHelper
from minivllm.lora.punica_wrapper import PunicaWrapper
from minivllm.lora.request import LoRARequest

_LAYER_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")
_LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAModel:
    """One adapter in host memory: (layer, HF module name) -> (A [r, in], B [out, r] x scaling).

    Scaling is folded into B here, once, so the kernels never see lora_alpha.
    """

    def __init__(self, lora_int_id: int, rank: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]):
        self.id, self.rank, self.weights = lora_int_id, rank, weights

    @classmethod
    def from_local_checkpoint(cls, request: LoRARequest, peft: PEFTHelper, dtype: torch.dtype) -> LoRAModel:
        tensors = load_file(str(Path(request.lora_path).expanduser() / WEIGHTS_FILE), device="cpu")
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, (layer, module, which, _) in peft.tensors.items():
            pairs.setdefault((layer, module), {})[which] = tensors[name]
        weights = {key: (p["A"].to(dtype), (p["B"].float() * peft.scaling).to(dtype)) for key, p in pairs.items()}
        return cls(request.lora_int_id, peft.r, weights)

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


class LoRAModelManager:
    """The model's LoRA layers and `max_loras` GPU slots with LRU replacement.

    Args: model (loaded), max_loras, max_lora_rank, max_num_tokens (rows of the largest
    forward pass), backend ("torch" / "triton"). The model's parameters give the device.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_num_tokens: int,
                 backend: str) -> None:
        self.model, self.max_loras = model, max_loras
        device = next(model.parameters()).device
        self.punica = PunicaWrapper(max_num_tokens, max_loras, device, backend)
        # Our fused module -> its HF parts in slice order ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}).
        self.packed: dict[str, list[str]] = {}
        for fused, part, _ in getattr(model, "stacked_params_mapping", []):
            self.packed.setdefault(fused, []).append(part)
        self.lora_layers: dict[tuple[int, str], BaseLayerWithLoRA] = {}
        self._replace_modules(max_lora_rank)
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first

    def _replace_modules(self, max_lora_rank: int) -> None:
        for name, module in list(self.model.named_modules()):
            match = _LAYER_NAME.search(name)
            if match is None or match.group(2) not in _LORA_MODULES:
                continue
            lora_layer = from_layer(module)
            lora_layer.create_lora_weights(self.max_loras, max_lora_rank, self.punica)
            parent_name, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), child, lora_layer)
            self.lora_layers[(int(match.group(1)), match.group(2))] = lora_layer

    def activate(self, lora: LoRAModel, keep: set[int]) -> int:
        """The slot holding `lora`, copying it in first if needed (evicting the least recently
        used adapter not in `keep`, the ids the current batch needs)."""
        if lora.id in self.slots:
            self.slots.move_to_end(lora.id)
            return self.slots[lora.id]
        if len(self.slots) < self.max_loras:
            slot = len(self.slots)
        else:
            victim = next((i for i in self.slots if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one batch "
                                   "(the scheduler should have prevented it).")
            slot = self.slots.pop(victim)
        for (layer, fused), lora_layer in self.lora_layers.items():
            parts = self.packed.get(fused, [fused])
            lora_layer.set_lora(slot, [lora.weights.get((layer, part)) for part in parts])
        self.slots[lora.id] = slot
        return slot

    def remove(self, lora_int_id: int) -> None:
        """Forget the adapter (its slot is reused by the next one)."""
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            for lora_layer in self.lora_layers.values():
                lora_layer.reset_lora(slot)
            # Keep slot numbers dense: move the highest-numbered slot's adapter into the hole.
            self._compact(slot)

    def _compact(self, hole: int) -> None:
        last = len(self.slots)
        if hole == last:
            return
        moved = next(i for i, s in self.slots.items() if s == last)
        for lora_layer in self.lora_layers.values():
            for a, b in zip(lora_layer.lora_a, lora_layer.lora_b):
                a[hole].copy_(a[last])
                b[hole].copy_(b[last])
            lora_layer.reset_lora(last)
        self.slots[moved] = hole

    def set_active(self, loras: dict[int, LoRAModel], token_lora_ids: list[int]) -> None:
        """Load the batch's adapters into slots and map every token (lora id 0: the base)."""
        slot_of = {lora_id: self.activate(lora, set(loras)) for lora_id, lora in loras.items()}
        self.punica.update([slot_of.get(i, -1) if i else -1 for i in token_lora_ids])
