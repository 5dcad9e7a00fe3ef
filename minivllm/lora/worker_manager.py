"""The worker's side of multi-LoRA: `LRUCacheWorkerLoRAManager` (vLLM's
`vllm/lora/worker_manager.py`).

Two caches, both least-recently-used:
    CPU  up to `max_cpu_loras` adapters read from disk (`LoRAModel`), so an adapter that
         comes back is not read again;
    GPU  up to `max_loras` slots (`LoRAModelManager`), filled from the CPU cache.

The model runner calls `set_active_adapters` once per step with the step's requests; an
adapter seen for the first time is read then. The engine has already checked it
(`peft_helper.load_peft_helper`), so a read here fails only if the folder changed since.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from minivllm.config import LoRAConfig
from minivllm.lora.models import LoRAModel, LoRAModelManager
from minivllm.lora.peft_helper import load_peft_helper
from minivllm.lora.request import LoRARequest
from minivllm.sequence import SequenceGroupMetadata


class LRUCacheWorkerLoRAManager:
    """Args: model (loaded; its projections are replaced here), lora_config, hf_config (the
    base model's, to check adapters), max_num_tokens, backend."""

    def __init__(self, model: nn.Module, lora_config: LoRAConfig, hf_config: Any, max_num_tokens: int,
                 backend: str) -> None:
        self.lora_config, self.hf_config = lora_config, hf_config
        self.dtype = next(model.parameters()).dtype
        self.manager = LoRAModelManager(model, lora_config.max_loras, lora_config.max_lora_rank, max_num_tokens,
                                        backend)
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()

    def get(self, request: LoRARequest) -> LoRAModel:
        """The adapter from the CPU cache, read from disk on a miss (evicting the LRU one)."""
        if request.lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return self.cpu_cache[request.lora_int_id]
        peft = load_peft_helper(request.lora_path, self.hf_config, self.lora_config.max_lora_rank)
        lora = LoRAModel.from_local_checkpoint(request, peft, self.dtype)
        if len(self.cpu_cache) >= self.lora_config.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        self.cpu_cache[request.lora_int_id] = lora
        return lora

    def remove_adapter(self, lora_int_id: int) -> None:
        self.cpu_cache.pop(lora_int_id, None)
        self.manager.remove(lora_int_id)

    def list_adapters(self) -> list[int]:
        return list(self.cpu_cache)

    @torch.inference_mode()
    def set_active_adapters(self, seq_group_metadata_list: list[SequenceGroupMetadata],
                            token_lora_ids: list[int]) -> None:
        """Make this step's adapters resident and map each token (`token_lora_ids`: the
        request's lora id per token in batch order, 0 for the base model)."""
        requests = {m.lora_request.lora_int_id: m.lora_request for m in seq_group_metadata_list if m.lora_request}
        self.manager.set_active({i: self.get(r) for i, r in requests.items()}, token_lora_ids)
