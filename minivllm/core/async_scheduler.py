"""The scheduler of async scheduling: `AsyncScheduler.schedule_ahead`.

A `Scheduler` that can plan the next multi-step run while the current run's last step is still
on the device (vLLM's async scheduling; `minivllm/engine/async_scheduling.py` queues the run).
Each sequence then has one token in flight, sampled on the device but not yet appended by the
host: it takes the slot after the host's last token, so every group reserves one slot more
(`_can_append_slots`, `_append_slots`) and may generate one token fewer (`_tokens_left`). The
engine picks this class when `SchedulerConfig.async_scheduling` is on.
"""

from __future__ import annotations

from collections import deque

from minivllm.core.scheduler import Scheduler, SchedulerOutputs, _StepState
from minivllm.sequence import SequenceGroup, SequenceGroupMetadata


class AsyncScheduler(Scheduler):
    """`Scheduler` plus `schedule_ahead`; outside it, every answer is the plain scheduler's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Tokens each running sequence has on the device, sampled but not yet appended
        # (1 while `schedule_ahead` runs, else 0).
        self._in_flight_tokens = 0

    def schedule_ahead(self, in_flight: set[str]) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs] | None:
        """The next run's metadata and decision, scheduled while the current run's last step is
        still on the device; None when only the host's full decision can tell.

        in_flight: the request ids whose sequence has a token on the device that the host has
        not appended yet (the current run's last step samples it). The next run starts one
        position later, so each group reserves one slot more and may generate one token
        fewer; a group whose in-flight token is its last (max_tokens, max_model_len) is left
        out, since it finishes as soon as the engine processes that token.

        Only the plain case is scheduled ahead: nothing waiting or swapped (no prompt to
        admit, nothing to swap in), every other running group a lone sequence with a token
        in flight, and free blocks enough that no one is preempted. Returns None otherwise,
        and the engine schedules after the last step as usual.
        """
        if self.waiting or self.swapped or not self.running:
            return None
        finishing, going_on = [], []
        for seq_group in self.running:
            # (Only a token in flight can be the last: a group with one token left and none in
            # flight must run, so it goes on and vetoes the schedule below.)
            last = seq_group.is_finished() or (seq_group.request_id in in_flight and self._tokens_left(seq_group) <= 1)
            (finishing if last else going_on).append(seq_group)
        if not going_on or any(g.request_id not in in_flight or g.num_seqs() != 1 for g in going_on):
            return None
        if all(self._tokens_left(g) <= 2 for g in going_on):
            return None  # the next run would be one step: nothing to queue ahead of the host
        # Conservatively what `can_append_slots` asks of each group, all at once.
        blocks_each = 1 + -(-(self.scheduler_config.num_lookahead_slots + 1) // self.block_manager.block_size)
        if blocks_each * len(going_on) > self.block_manager.get_num_free_gpu_blocks():
            return None
        self.running = deque(going_on)
        self._in_flight_tokens = 1
        try:
            metadata, outputs, _ = self.schedule()
        finally:
            self._in_flight_tokens = 0
            self.running.extend(finishing)
        if outputs.preempted or outputs.ignored_seq_groups or len(outputs.scheduled_seq_groups) != len(going_on):
            raise RuntimeError(f"schedule_ahead scheduled {len(outputs.scheduled_seq_groups)} of {len(going_on)} "
                               f"groups (preempted {outputs.preempted}): its checks should have refused.")
        return metadata, outputs

    def _tokens_left(self, seq_group: SequenceGroup) -> int:
        return super()._tokens_left(seq_group) - self._in_flight_tokens

    def _can_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> bool:
        return super()._can_append_slots(seq_group, num_lookahead_slots + self._in_flight_tokens)

    def _append_slots(self, seq_group: SequenceGroup, state: _StepState, num_lookahead_slots: int = 0) -> None:
        super()._append_slots(seq_group, state, num_lookahead_slots + self._in_flight_tokens)
