"""`AsyncScheduler.schedule_ahead` (async scheduling) under random workloads, without a model.

A small driver does what the engine does with multi-step runs: each run computes one
token per step for each group (its chunk first, then as many steps as it reserved slots),
and before the run's last step is "processed" the next run is scheduled ahead. Requests
arrive late, stop early at random positions (as EOS would), or run to max_tokens and
max_model_len. For every workload the same requests also run with async scheduling off; we
check:

- a run scheduled ahead never preempts, ignores or swaps anyone, holds only decodes of
  sequences with a token in flight, and reserves blocks for that token and its lookahead;
- nothing is scheduled ahead while a prompt waits or a group is swapped out;
- every request produces the same number of tokens and ends the same way as without it;
- afterwards every block is free.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

TOKEN = 7
MAX_RUNS = 2_000


def drive(scheduler_config: SchedulerConfig, cache_config: CacheConfig, requests) -> dict:
    """Run every request to its end; request id -> (tokens produced, final status)."""
    scheduler_class = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
    scheduler = scheduler_class(scheduler_config, cache_config)
    seq_ids = itertools.count()
    groups = {}
    pending = sorted(requests, key=lambda r: r["arrival"])
    ahead, run_index = None, 0
    while pending or scheduler.has_unfinished_seqs():
        while pending and pending[0]["arrival"] <= run_index:
            request = pending.pop(0)
            seq = Sequence(next(seq_ids), None, request["prompt"], cache_config.block_size)
            group = SequenceGroup(request["id"], [seq], 0.0, SamplingParams(max_tokens=request["max_tokens"]))
            group.stop_at = request["stop_at"]
            groups[request["id"]] = group
            scheduler.add_seq_group(group)
        if ahead is None:
            _, outputs, _ = scheduler.schedule()
        else:
            outputs, ahead = ahead, None
        scheduled = outputs.scheduled_seq_groups
        num_steps = 1 + max((s.num_lookahead_slots for s in scheduled), default=0)
        for step in range(num_steps):
            for s in scheduled:
                _process(scheduler, s, step, scheduler_config.max_model_len)
            if scheduler_config.async_scheduling and num_steps > 1 and step == num_steps - 2:
                ahead = _schedule_ahead(scheduler, scheduled, num_steps)
        scheduler.free_finished_seq_groups()
        run_index += 1
        assert run_index < MAX_RUNS, "the workload did not finish: a hang"
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == cache_config.num_gpu_blocks
    assert not bm.block_tables
    return {rid: (g.first_seq.get_output_len(), g.first_seq.status) for rid, g in groups.items()}


def _process(scheduler: Scheduler, scheduled, step: int, max_model_len: int) -> None:
    """One model step's result for one group, as the engine applies it."""
    group = scheduled.seq_group
    if group.is_finished() or step > scheduled.num_lookahead_slots:
        return
    group.update_num_computed_tokens(scheduled.token_chunk_size if step == 0 else 1)
    seq = group.first_seq
    if seq.get_num_uncomputed_tokens():
        return  # a prompt chunk short of its end samples nothing
    seq.append_token_id(TOKEN, {TOKEN: 0.0})
    if seq.get_output_len() == group.stop_at:
        seq.status = SequenceStatus.FINISHED_STOPPED  # as EOS would
    elif seq.get_output_len() >= group.sampling_params.max_tokens or seq.get_len() >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED


def _schedule_ahead(scheduler: Scheduler, scheduled, num_steps: int):
    """The engine's `_schedule_ahead`, checking the scheduler's answer."""
    scheduler.free_finished_seq_groups()
    in_flight = {s.seq_group.request_id for s in scheduled
                 if s.num_lookahead_slots == num_steps - 1 and not s.seq_group.is_finished()}
    could = not scheduler.waiting and not scheduler.swapped
    lengths = {g.request_id: (g.first_seq.get_len(), g.first_seq.get_output_len()) for g in scheduler.running}
    result = scheduler.schedule_ahead(in_flight)
    if result is None:
        return None
    assert could, "scheduled ahead while a prompt waited or a group was swapped out"
    _, outputs = result
    assert not outputs.preempted and not outputs.ignored_seq_groups
    assert not (outputs.blocks_to_swap_in or outputs.blocks_to_swap_out)
    size = scheduler.block_manager.block_size
    for s in outputs.scheduled_seq_groups:
        group = s.seq_group
        assert group.request_id in in_flight and s.token_chunk_size == 1
        table = scheduler.block_manager.get_block_table(group.first_seq)
        length, output_len = lengths[group.request_id]
        # The token in flight and every lookahead slot after it have a slot...
        assert len(table) * size >= length + 1 + s.num_lookahead_slots
        # ... and none is reserved for a token the request may never generate (the run's
        # last token is sampled, never computed: hence the second 1).
        assert output_len + 1 + 1 + s.num_lookahead_slots <= group.sampling_params.max_tokens
        assert length + 1 + 1 + s.num_lookahead_slots <= scheduler.scheduler_config.max_model_len
    assert {g.request_id for g in scheduler.running} >= {s.seq_group.request_id for s in outputs.scheduled_seq_groups}
    return outputs


@st.composite
def workloads(draw):
    max_model_len = draw(st.integers(8, 48))
    steps = draw(st.integers(2, 5))
    scheduler_config = dict(max_num_seqs=draw(st.integers(1, 6)), max_model_len=max_model_len,
                            max_num_batched_tokens=max_model_len + draw(st.integers(0, 32)),
                            enable_chunked_prefill=False, num_scheduler_steps=steps,
                            preemption_mode=draw(st.sampled_from([None, "recompute"])))
    cache_config = dict(block_size=draw(st.sampled_from([1, 2, 4, 8])), num_gpu_blocks=draw(st.integers(8, 40)),
                        enable_prefix_caching=draw(st.booleans()))
    requests = [{"id": str(i), "prompt": draw(st.lists(st.integers(1, 3), min_size=1, max_size=max_model_len // 2)),
                 "max_tokens": draw(st.integers(1, 24)), "stop_at": draw(st.integers(1, 30)),
                 "arrival": draw(st.integers(0, 6))}
                for i in range(draw(st.integers(1, 6)))]
    return scheduler_config, cache_config, requests


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_scheduling_ahead_keeps_the_invariants_and_the_outcome(workload):
    scheduler_args, cache_args, requests = workload
    outcomes = {}
    for async_scheduling in (False, True):
        cache_config = CacheConfig(num_cpu_blocks=0, **cache_args)
        scheduler_config = SchedulerConfig(async_scheduling=async_scheduling, **scheduler_args)
        outcomes[async_scheduling] = drive(scheduler_config, cache_config, requests)
    assert outcomes[True] == outcomes[False]


def test_a_run_is_scheduled_ahead_with_one_more_slot_and_one_token_fewer():
    """Two decodes with a token in flight: both reserve the slot of that token, and a group
    whose in-flight token reaches max_tokens is left out but stays running."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64, num_scheduler_steps=4, async_scheduling=True),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    groups = []
    for i, max_tokens in enumerate((20, 3)):
        seq = Sequence(i, None, [1, 2, 3, 4, 5], 4)
        groups.append(SequenceGroup(str(i), [seq], 0.0, SamplingParams(max_tokens=max_tokens)))
        scheduler.add_seq_group(groups[-1])
    _, outputs, _ = scheduler.schedule()  # the prompts
    for s in outputs.scheduled_seq_groups:
        s.seq_group.update_num_computed_tokens(s.token_chunk_size)
        s.seq_group.first_seq.append_token_id(TOKEN, {TOKEN: 0.0})
    _, outputs, _ = scheduler.schedule()  # decodes: group 0 reserves 3 slots, group 1 (2 left) 1
    assert [s.num_lookahead_slots for s in outputs.scheduled_seq_groups] == [3, 1]
    for s in outputs.scheduled_seq_groups:  # the host processes the first step: 2 tokens each
        s.seq_group.update_num_computed_tokens(1)
        s.seq_group.first_seq.append_token_id(TOKEN, {TOKEN: 0.0})
    # Both have a token in flight; group 1's is its third and last: only group 0 is scheduled ahead.
    result = scheduler.schedule_ahead({"0", "1"})
    assert result is not None
    _, ahead = result
    assert [s.seq_group.request_id for s in ahead.scheduled_seq_groups] == ["0"]
    seq = groups[0].first_seq  # length 7; in flight: position 7; lookahead: 8, 9, 10
    assert ahead.scheduled_seq_groups[0].num_lookahead_slots == 3
    assert len(scheduler.block_manager.get_block_table(seq)) * 4 >= 7 + 1 + 3
    assert {g.request_id for g in scheduler.running} == {"0", "1"}  # group 1 finishes later


def test_nothing_is_scheduled_ahead_while_a_prompt_waits_or_a_group_lacks_a_token_in_flight():
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64, num_scheduler_steps=4, async_scheduling=True),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    first = SequenceGroup("0", [Sequence(0, None, [1, 2, 3], 4)], 0.0, SamplingParams(max_tokens=20))
    scheduler.add_seq_group(first)
    _, outputs, _ = scheduler.schedule()
    first.update_num_computed_tokens(3)
    first.first_seq.append_token_id(TOKEN, {TOKEN: 0.0})
    assert scheduler.schedule_ahead(set()) is None  # "0" has no token in flight
    scheduler.add_seq_group(SequenceGroup("1", [Sequence(1, None, [1, 2], 4)], 0.0, SamplingParams(max_tokens=4)))
    assert scheduler.schedule_ahead({"0"}) is None  # "1" waits for its prefill


def test_a_group_with_one_token_left_and_none_in_flight_is_not_left_out():
    """One token left but nothing in flight (its last run was cut short, e.g. for blocks): it
    must run, so nothing is scheduled ahead without it (left out, it would wait for ever
    while the others kept running ahead)."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64, num_scheduler_steps=4, async_scheduling=True),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    groups = []
    for i, max_tokens in enumerate((20, 2)):
        groups.append(SequenceGroup(str(i), [Sequence(i, None, [1, 2, 3], 4)], 0.0, SamplingParams(max_tokens=max_tokens)))
        scheduler.add_seq_group(groups[-1])
    _, outputs, _ = scheduler.schedule()
    for s in outputs.scheduled_seq_groups:
        s.seq_group.update_num_computed_tokens(s.token_chunk_size)
        s.seq_group.first_seq.append_token_id(TOKEN, {TOKEN: 0.0})
    # Group 1 has one token left and none in flight; group 0 has one in flight.
    assert scheduler.schedule_ahead({"0"}) is None
    assert {g.request_id for g in scheduler.running} == {"0", "1"}


def test_no_run_is_scheduled_ahead_when_it_would_be_one_step():
    """Every group with two tokens left: one in flight and one more, a one-step run that the
    multi-step worker does not run; it is scheduled after the host catches up instead."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64, num_scheduler_steps=4, async_scheduling=True),
                          CacheConfig(block_size=4, num_gpu_blocks=32))
    group = SequenceGroup("0", [Sequence(0, None, [1, 2, 3], 4)], 0.0, SamplingParams(max_tokens=3))
    scheduler.add_seq_group(group)
    scheduler.schedule()
    group.update_num_computed_tokens(3)
    group.first_seq.append_token_id(TOKEN, {TOKEN: 0.0})
    assert scheduler.schedule_ahead({"0"}) is None
