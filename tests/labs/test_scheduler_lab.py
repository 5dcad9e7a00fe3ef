"""Lab 03's checks (`minivllm/labs/scheduler.py`) pass on the package's own budget and scheduler
and fail, naming the case, on versions that break one of vLLM v0's rules each."""

from __future__ import annotations

from collections import deque

import pytest

from minivllm.core.block_manager import AllocStatus
from minivllm.core.scheduler import PreemptionMode, Scheduler, SchedulingBudget
from minivllm.labs import LabCheckFailed
from minivllm.labs.scheduler import STEP_CASES, check_budget, check_scheduler_in_engine, check_scheduler_step


# ------------------------------------------------------------------ wrong budgets
class CountsTwice(SchedulingBudget):
    """Adds a request's tokens every time it is added."""

    def add_num_batched_tokens(self, request_id, num_batched_tokens):
        self._token_request_ids.add(request_id)
        self.num_batched_tokens += num_batched_tokens


class StrictlyBelow(SchedulingBudget):
    """A request that exactly fills the budget does not fit."""

    def can_schedule(self, *, num_new_tokens, num_new_seqs):
        return (self.num_batched_tokens + num_new_tokens < self.token_budget
                and self.num_curr_seqs + num_new_seqs <= self.max_num_seqs)


class SubtractsUncounted(SchedulingBudget):
    """Subtracts sequences that were never counted."""

    def subtract_num_seqs(self, request_id, num_curr_seqs):
        self._seq_request_ids.discard(request_id)
        self.num_curr_seqs -= num_curr_seqs


# --------------------------------------------------------------- wrong schedulers
class IgnoresTokens(SchedulingBudget):
    def can_schedule(self, *, num_new_tokens, num_new_seqs):
        return self.num_curr_seqs + num_new_seqs <= self.max_num_seqs

    def remaining_token_budget(self):
        return 1 << 30


class AdmitsPastTheBudget(Scheduler):
    """Admits waiting prompts whatever their token count."""

    def _start_step(self):
        state = super()._start_step()
        budget = IgnoresTokens(state.budget.token_budget, state.budget.max_num_seqs)
        for seq_group in self.running:
            budget.add_num_seqs(seq_group.request_id, seq_group.get_max_num_running_seqs())
        state.budget = budget
        return state


class Overtakes(Scheduler):
    """Lets a prompt behind a LATER head be admitted (no head-of-line blocking)."""

    def _schedule_prefills(self, state, enable_chunking):
        passed_over = []
        while True:
            super()._schedule_prefills(state, enable_chunking)
            if not self.waiting or self.block_manager.can_allocate(self.waiting[0]) != AllocStatus.LATER:
                break
            passed_over.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(passed_over))


class PreemptsTheOldest(Scheduler):
    """Takes victims from the front of the running queue."""

    def _make_room_for(self, seq_group, state, num_lookahead_slots=0):
        while not self._can_append_slots(seq_group, num_lookahead_slots):
            victim = self.running.popleft() if self.running else seq_group
            state.budget.subtract_num_seqs(victim.request_id, victim.get_max_num_running_seqs())
            self._preempt(victim, state)
            if victim is seq_group:
                return False
        return True


class AlwaysRecomputes(Scheduler):
    """Ignores preemption_mode="swap" for a lone sequence."""

    def _preemption_mode(self, seq_group):
        mode = super()._preemption_mode(seq_group)
        return PreemptionMode.RECOMPUTE if seq_group.num_seqs() == 1 else mode


class SwapsInBeforeRoom(Scheduler):
    """Swaps a group back in without asking whether its blocks fit."""

    def _schedule_swapped(self, state, enable_chunking):
        while self.swapped and self.block_manager.get_num_free_gpu_blocks() > 0:
            seq_group = self.swapped.popleft()
            try:
                state.blocks_to_swap_in.extend(self.block_manager.swap_in(seq_group))
            except Exception:
                self.swapped.appendleft(seq_group)
                break
            for seq in seq_group.get_seqs():
                if not seq.is_finished():
                    seq.status = seq.status.RUNNING
            self._add_running(seq_group, state, seq_group.num_seqs())


class KeepsBlocksOnRecompute(Scheduler):
    """Sends a recomputed group back to waiting without freeing its blocks."""

    def _preempt_by_recompute(self, seq_group, state):
        for seq in seq_group.get_seqs(status=seq_group.first_seq.status):
            seq.status = seq.status.WAITING
            seq.reset_state_for_recompute()
        self.num_cumulative_preemption += 1
        state.preempted_by_recompute.append(seq_group)


class ForgetsToCount(Scheduler):
    """Preempts right but never counts a preemption."""

    def _preempt(self, seq_group, state):
        super()._preempt(seq_group, state)
        self.num_cumulative_preemption = 0


# ------------------------------------------------------------------------ tests
def test_the_checks_pass_on_the_package():
    check_budget(SchedulingBudget)
    check_scheduler_step(Scheduler)


@pytest.mark.parametrize("budget_cls, message", [
    (CountsTwice, "count once"),
    (StrictlyBelow, "exactly fills the token budget"),
    (SubtractsUncounted, "never counted"),
])
def test_budget_check_names_the_broken_rule(budget_cls, message):
    with pytest.raises(LabCheckFailed, match=message):
        check_budget(budget_cls)


@pytest.mark.parametrize("scheduler_cls, message", [
    (AdmitsPastTheBudget, "the token budget caps a prefill step"),
    (Overtakes, r"\(LATER\) blocks every prompt"),
    (PreemptsTheOldest, "preempt the newest running group"),
    (AlwaysRecomputes, "preemption by swap"),
    (SwapsInBeforeRoom, "swap"),
    (KeepsBlocksOnRecompute, "recompute"),
])
def test_step_check_names_the_first_case_a_wrong_scheduler_fails(scheduler_cls, message):
    with pytest.raises(LabCheckFailed, match=message):
        check_scheduler_step(scheduler_cls)


def test_step_check_says_which_step_and_field_differ():
    with pytest.raises(LabCheckFailed) as failure:
        check_scheduler_step(PreemptsTheOldest)
    text = str(failure.value)
    assert "step case 5" in text and "expected" in text and "your step" in text


def test_skeleton_not_implemented_propagates():
    class Skeleton(Scheduler):
        def _schedule_prefills(self, state, enable_chunking):
            raise NotImplementedError("write `_schedule_prefills`")

    with pytest.raises(NotImplementedError):
        check_scheduler_step(Skeleton)


def test_engine_check_passes_on_the_package_in_both_modes():
    check_scheduler_in_engine(Scheduler)


def test_engine_check_wants_the_preemptions_counted():
    with pytest.raises(LabCheckFailed, match="without a preemption"):
        check_scheduler_in_engine(ForgetsToCount, modes=("recompute",))


class AdmitsNothing(Scheduler):
    """A skeleton whose admission returns without doing anything."""

    def _schedule_prefills(self, state, enable_chunking):
        return None


def test_engine_check_fails_instead_of_hanging_on_a_scheduler_that_runs_nothing():
    with pytest.raises(LabCheckFailed, match="scheduled nothing for 100 steps"):
        check_scheduler_in_engine(AdmitsNothing, modes=("recompute",))


def test_a_learner_scheduler_s_demo_run_is_bounded():
    with pytest.raises(RuntimeError, match="did not finish within"):
        STEP_CASES[5].run(AdmitsNothing)
