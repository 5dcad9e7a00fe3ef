"""Which adapter a request runs with: `LoRARequest` (vLLM's `vllm/lora/request.py`).

    LoRARequest("sql", 1, "/adapters/sql-lora")   # name, id, PEFT folder

`lora_int_id` is the adapter's identity everywhere below the engine: the scheduler counts
distinct ids per batch, the block manager puts it into the prefix-cache hash (two adapters
never share KV: their keys and values differ), the worker keys its caches by it. It must be
at least 1; 0 and None mean the base model. One id names one adapter for the engine's life.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer of at least 1 (0 is the base model), "
                             f"got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a folder, got {self.lora_path!r}.")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
