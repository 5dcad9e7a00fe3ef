"""The scheduler's one LoRA extension point: how many distinct adapters may run at once.

Mirrors the `curr_loras` bookkeeping of `vllm/core/scheduler.py` (`_schedule_prefills`,
`_schedule_swapped`): at most `max_loras` distinct adapters among the running groups, so in any
batch. A waiting or swapped group whose adapter would be one too many is passed over (the groups
behind it may go first) until one finishes. `NoLoRASlots` is the engine without LoRA: every group
is admitted and nothing is tracked, so the plain scheduler calls it without asking.

    slots = LoRASlots.from_config(LoRAConfig(max_loras=2, max_lora_rank=8))
    in_use = slots.in_use(running)                 # {1, 7}: adapter ids of the running groups
    slots.admits(group_with_adapter_3, in_use)     # False: a third adapter
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.config import LoRAConfig
from minivllm.sequence import SequenceGroup


class LoRASlots:
    """`max_loras` adapter slots; adapter id 0 is the base model and takes none."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    @staticmethod
    def from_config(lora_config: LoRAConfig | None) -> LoRASlots:
        """The slots of `lora_config` (the scheduler's vLLM argument); `NoLoRASlots` for None."""
        if lora_config is None:
            return NoLoRASlots()
        if not isinstance(lora_config, LoRAConfig):
            raise ValueError(f"lora_config must be a LoRAConfig or None, got {type(lora_config).__name__}.")
        return LoRASlots(lora_config.max_loras)

    def in_use(self, running: Iterable[SequenceGroup]) -> set[int]:
        """The adapter ids the running groups hold (a step adds to this set with `take`)."""
        return {g.lora_int_id for g in running if g.lora_int_id}

    def admits(self, seq_group: SequenceGroup, in_use: set[int]) -> bool:
        """False if running `seq_group` would put max_loras + 1 distinct adapters in the batch."""
        lora_id = seq_group.lora_int_id
        return lora_id == 0 or lora_id in in_use or len(in_use) < self.max_loras

    def take(self, seq_group: SequenceGroup, in_use: set[int]) -> None:
        """`seq_group` was scheduled: its adapter now holds a slot."""
        if seq_group.lora_int_id:
            in_use.add(seq_group.lora_int_id)


class NoLoRASlots(LoRASlots):
    """No LoRA: every group is admitted and no slot is counted."""

    def __init__(self) -> None:
        super().__init__(max_loras=0)

    def in_use(self, running: Iterable[SequenceGroup]) -> set[int]:
        return set()

    def admits(self, seq_group: SequenceGroup, in_use: set[int]) -> bool:
        return True

    def take(self, seq_group: SequenceGroup, in_use: set[int]) -> None:
        pass
