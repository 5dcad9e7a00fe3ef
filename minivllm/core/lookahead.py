"""Lookahead slots: what a decode reserves beyond its next token for the further steps of a
multi-step run (`SchedulerConfig.num_lookahead_slots`, from `num_scheduler_steps` or
speculative decoding). vLLM v0: `Scheduler._get_num_lookahead_slots` in
`vllm/core/scheduler.py`. The plain engine has none (`num_lookahead_slots == 0`).
"""

from __future__ import annotations

from minivllm.sequence import SequenceGroup


class LookaheadSlotsMixin:
    """The `Scheduler`'s lookahead slots; needs its config and `_can_append_slots`."""

    def _num_lookahead_slots(self, seq_group: SequenceGroup) -> int:
        """Slots to reserve beyond a decode's next token: 0 unless they fit without preempting
        anyone (lookahead is a bonus).

        Only for a lone sequence (n = best_of = 1, no beam search): forks share blocks, and a
        multi-step run feeds each sampled token straight back, which only works when every row
        continues one sequence. Never more than the sequence may still generate (max_tokens,
        max_model_len), so no block is reserved that could never be written.
        """
        params = seq_group.sampling_params
        num_slots = self.scheduler_config.num_lookahead_slots
        if num_slots == 0 or params.best_of > 1 or params.use_beam_search:
            return 0
        num_slots = max(0, min(num_slots, self._tokens_left(seq_group) - 1))
        return num_slots if self._can_append_slots(seq_group, num_slots) else 0

    def _tokens_left(self, seq_group: SequenceGroup) -> int:
        """Tokens a lone sequence may still generate (max_tokens, max_model_len)."""
        seq = seq_group.first_seq
        remaining = self.scheduler_config.max_model_len - seq.get_len()
        if seq_group.sampling_params.max_tokens is not None:
            remaining = min(remaining, seq_group.sampling_params.max_tokens - seq.get_output_len())
        return remaining
