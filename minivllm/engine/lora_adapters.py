"""The adapters an engine accepts: `LoRAAdapters`, behind `LLMEngine.add_lora` / `remove_lora`
(`LoRAEngineMixin`).

vLLM's `LLMEngine.add_lora` hands the request to the executor's LoRA manager; here the engine
checks the adapter against the base model once (`minivllm.lora.peft_helper`) and keeps it by id,
and the workers read its weights when a batch first needs it. Without `enable_lora` every
adapter is refused, and a request without one (`None`) passes through.
"""

from __future__ import annotations

from minivllm.config import LoRAConfig
from minivllm.lora.peft_helper import load_peft_helper
from minivllm.lora.request import LoRARequest


class LoRAAdapters:
    """`LoRARequest`s checked against the base model, by `lora_int_id`."""

    def __init__(self, lora_config: LoRAConfig | None, hf_config) -> None:
        self.lora_config = lora_config
        self.hf_config = hf_config
        self._by_id: dict[int, LoRARequest] = {}

    def use(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter: checked and added if new (None: the base model)."""
        if lora_request is not None:
            self.add(lora_request)

    def add(self, lora_request: LoRARequest) -> bool:
        """Check and remember an adapter (ValueError naming the problem); False if its id was
        already added with the same adapter."""
        if self.lora_config is None:
            raise ValueError("a lora_request needs an engine with enable_lora=True.")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        known = self._by_id.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(f"lora_int_id {known.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"at {known.lora_path!r}: one id per adapter.")
            return False
        load_peft_helper(lora_request.lora_path, self.hf_config, self.lora_config.max_lora_rank)
        self._by_id[lora_request.lora_int_id] = lora_request
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if unknown. Its id must not be reused for another adapter:
        the workers' caches are keyed by it."""
        return self._by_id.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        return set(self._by_id)


class LoRAEngineMixin:
    """`LLMEngine`'s adapter calls (vLLM's names), over its `LoRAAdapters` (`self._loras`)."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the base model (ValueError naming the problem) and remember
        it; False if this id was already added. The workers read its weights when a batch
        first needs it (`LoRAAdapters.add`)."""
        return self._loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already queued with it still finish); False if unknown."""
        return self._loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return self._loras.ids()
