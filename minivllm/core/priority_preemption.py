"""Priority preemption: `Scheduler._schedule_priority_preemption` (vLLM v0's, in
`vllm/core/scheduler.py`), run each step under `policy="priority"` before the running groups.

The waiting head may preempt, by recompute, running groups of lower priority (a larger
`priority`, then a later arrival) from the back until it fits; a group of several sequences
cannot be recomputed and stops the search. A head that can never be admitted preempts no one.
"""

from __future__ import annotations

from collections import deque

from minivllm.core.block_manager import AllocStatus
from minivllm.sequence import SequenceGroup, SequenceStatus


class PriorityPreemptionMixin:
    """The `Scheduler`'s priority preemption; needs its queues, policy and preemption methods."""

    def _schedule_priority_preemption(self, state, enable_chunking: bool) -> None:
        """Recompute running groups of lower priority than the waiting head until it fits."""
        if not self.waiting:
            return
        head = self.waiting[0]
        if self._why_never_admissible(head, state, self.block_manager.can_allocate(head)) is not None:
            return  # preempting others would not help it
        self.running = deque(sorted(self.running, key=self.policy.sort_key))
        while self.running and self.policy.sort_key(self.running[-1]) > self.policy.sort_key(head):
            if self._fits_now(head, state.budget, enable_chunking):
                break
            victim = self.running[-1]
            if victim.num_seqs(status=SequenceStatus.RUNNING) != 1:
                break  # several sequences cannot be recomputed; stop here
            self.running.pop()
            state.budget.subtract_num_seqs(victim.request_id, victim.get_max_num_running_seqs())
            self._preempt_by_recompute(victim, state)

    def _fits_now(self, seq_group: SequenceGroup, budget, enable_chunking: bool) -> bool:
        if self.block_manager.can_allocate(seq_group) != AllocStatus.OK:
            return False
        seq = self._waiting_seq(seq_group)
        num_new_tokens = 1 if enable_chunking else seq.get_len() - self.block_manager.get_num_cached_tokens(seq)
        return budget.can_schedule(num_new_tokens=num_new_tokens,
                                   num_new_seqs=seq_group.get_max_num_running_seqs())
