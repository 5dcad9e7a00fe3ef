"""The capstone's reference solution (used by tests/labs/test_capstone.py only): shortest job
first with a starvation bound, as a `scheduler_cls`.

The policy's key orders the waiting and swapped queues (and the running queue, whose back is
preempted first): requests that have waited `AGING_STEPS` scheduler steps first, in arrival
order; then the rest by the tokens their prefill needs, ties by arrival. Steps, not seconds,
so the order is the same on any machine.
"""

from __future__ import annotations

from minivllm.core.policy import Policy
from minivllm.core.scheduler import Scheduler
from minivllm.labs.capstone import AGING_STEPS
from minivllm.sequence import SequenceGroup


class AgedShortestFirst(Policy):
    """Sort key over a `ShortestJobFirst` scheduler's step count."""

    def __init__(self, scheduler: ShortestJobFirst) -> None:
        self.scheduler = scheduler

    def sort_key(self, seq_group: SequenceGroup) -> tuple:
        if self.scheduler.steps_waited(seq_group) >= AGING_STEPS:
            return (0, 0, seq_group.arrival_time)
        return (1, seq_group.first_seq.get_len(), seq_group.arrival_time)


class ShortestJobFirst(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy = AgedShortestFirst(self)
        self.num_steps = 0
        self._added_at: dict[str, int] = {}

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self._added_at[seq_group.request_id] = self.num_steps
        super().add_seq_group(seq_group)

    def steps_waited(self, seq_group: SequenceGroup) -> int:
        return self.num_steps - self._added_at.get(seq_group.request_id, self.num_steps)

    def schedule(self):
        try:
            return super().schedule()
        finally:
            self.num_steps += 1


class ShortestPromptFirst(Policy):
    """Shortest first without the starvation bound: a plain `PolicyFactory.register` policy."""

    def sort_key(self, seq_group: SequenceGroup) -> tuple:
        return (seq_group.first_seq.get_len(), seq_group.arrival_time)
