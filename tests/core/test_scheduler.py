"""Unit tests of the Scheduler, one scheduling path at a time.

Expected behaviour is vLLM v0's (`vllm/core/scheduler.py`, ~0.6) as documented there and in
the PagedAttention paper: FCFS admission with head-of-line blocking, AllocStatus
OK / LATER / NEVER, separate prefill and decode steps by default, decode-first chunked
prefill, preemption of the latest-arrived group (recompute for one sequence, swap for
several), priority preemption, prefix-cache skipping. Each test drives the real
BlockSpaceManager; a tiny stand-in model (`run_model`) appends tokens like the engine does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4
TOKEN = 7  # what the stand-in model always emits (never EOS: max_tokens stops requests)

_seq_ids = itertools.count()


def make_scheduler(num_gpu_blocks=64, num_cpu_blocks=0, *, max_num_seqs=8,
                   max_num_batched_tokens=None, max_model_len=64, chunked=False,
                   preemption_mode=None, policy="fcfs", caching=False) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, enable_chunked_prefill=chunked,
        preemption_mode=preemption_mode, policy=policy)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks,
                               num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=caching)
    return Scheduler(scheduler_config, cache_config)


def make_group(request_id, prompt_len=None, *, prompt=None, n=1, max_tokens=None,
               priority=0, arrival=0.0) -> SequenceGroup:
    prompt = prompt if prompt is not None else [100 + i for i in range(prompt_len)]
    seq = Sequence(next(_seq_ids), None, prompt, BLOCK_SIZE)
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return SequenceGroup(request_id, [seq], arrival, params, priority=priority)


def run_model(scheduler: Scheduler, outputs: SchedulerOutputs) -> None:
    """What the engine does after a step: computed tokens, sampled tokens, forks, frees."""
    for scheduled in outputs.scheduled_seq_groups:
        group = scheduled.seq_group
        group.update_num_computed_tokens(scheduled.token_chunk_size)
        seqs = group.get_seqs(status=SequenceStatus.RUNNING)
        if any(seq.get_num_uncomputed_tokens() for seq in seqs):
            continue  # a prompt chunk short of the end samples nothing
        if len(group.seqs) == 1 and group.sampling_params.n > 1:
            for _ in range(group.sampling_params.n - 1):
                child = group.first_seq.fork(next(_seq_ids))
                group.add(child)
                scheduler.fork_seq(group.first_seq, child)
        for seq in group.get_seqs(status=SequenceStatus.RUNNING):
            seq.append_token_id(TOKEN, {TOKEN: 0.0})
            max_tokens = group.sampling_params.max_tokens
            if max_tokens is not None and seq.get_output_len() >= max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    scheduler.free_finished_seq_groups()


@dataclass
class Moves:
    """Which requests one schedule() moved between queues (read from the queues)."""

    recomputed: list[str]  # running -> waiting: preempted by recompute
    swapped_out: list[str]  # running -> swapped: preempted by swap
    swapped_in: list[str]  # swapped -> running


def _queue_of(scheduler: Scheduler) -> dict[str, str]:
    return {g.request_id: name for name in ("waiting", "running", "swapped")
            for g in getattr(scheduler, name)}


def step_moves(scheduler: Scheduler):
    """schedule() + invariants + the stand-in model; returns (metadata, outputs, moves)."""
    before = _queue_of(scheduler)
    metadata, outputs, allow_async_output_proc = scheduler.schedule()
    assert allow_async_output_proc is False
    after = _queue_of(scheduler)
    moved = [(rid, before[rid], queue) for rid, queue in after.items() if rid in before]
    moves = Moves(*([rid for rid, src, dst in moved if (src, dst) == pair]
                    for pair in (("running", "waiting"), ("running", "swapped"), ("swapped", "running"))))
    check_invariants(scheduler, outputs)
    run_model(scheduler, outputs)
    return metadata, outputs, moves


def step(scheduler: Scheduler):
    """schedule() + invariants + the stand-in model; returns (metadata, outputs)."""
    metadata, outputs, _ = step_moves(scheduler)
    return metadata, outputs


def check_invariants(scheduler: Scheduler, outputs: SchedulerOutputs) -> None:
    config = scheduler.scheduler_config
    tokens = sum(s.token_chunk_size * s.seq_group.num_seqs(SequenceStatus.RUNNING)
                 for s in outputs.scheduled_seq_groups)
    seqs = sum(s.seq_group.num_seqs(SequenceStatus.RUNNING) for s in outputs.scheduled_seq_groups)
    assert outputs.num_batched_tokens == tokens <= config.max_num_batched_tokens
    assert seqs <= config.max_num_seqs
    ids = [g.request_id for q in (scheduler.waiting, scheduler.running, scheduler.swapped) for g in q]
    assert len(ids) == len(set(ids)), "a group sits in two queues"
    for group in scheduler.waiting:
        assert {s.status for s in group.get_unfinished_seqs()} == {SequenceStatus.WAITING}
    for group in scheduler.swapped:
        assert {s.status for s in group.get_unfinished_seqs()} == {SequenceStatus.SWAPPED}
    prefill_flags = [s.seq_group.is_prefill() for s in outputs.scheduled_seq_groups]
    assert prefill_flags == sorted(prefill_flags, reverse=True), "prefills must come first"
    decode_lens = [s.seq_group.seqs[0].get_len() for s in outputs.scheduled_seq_groups[outputs.num_prefill_groups:]]
    assert decode_lens == sorted(decode_lens, reverse=True), "decodes are listed longest first"


def run_to_completion(scheduler: Scheduler, max_steps=500) -> list[SchedulerOutputs]:
    history = []
    while scheduler.has_unfinished_seqs():
        assert len(history) < max_steps, "scheduler did not make progress"
        history.append(step(scheduler)[1])
    return history


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks


def scheduled_ids(outputs: SchedulerOutputs) -> list[str]:
    return [s.seq_group.request_id for s in outputs.scheduled_seq_groups]


# ==================================================================== admission
def test_requires_num_gpu_blocks():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig())


def test_fcfs_admission_respects_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_seq_group(make_group(str(i), 5, max_tokens=3, arrival=i))
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["0", "1"]
    assert outputs.num_prefill_groups == 2
    assert [g.request_id for g in scheduler.waiting] == ["2", "3"]


def test_token_budget_limits_prompts_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=64)
    for i in range(3):
        scheduler.add_seq_group(make_group(str(i), 30, max_tokens=2, arrival=i))
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["0", "1"]  # 30 + 30 fit in 64, a third would not
    assert outputs.num_batched_tokens == 60


def test_default_mode_separates_prefill_and_decode_steps():
    scheduler = make_scheduler()
    scheduler.add_seq_group(make_group("a", 5, max_tokens=10))
    step(scheduler)
    scheduler.add_seq_group(make_group("b", 5, max_tokens=10, arrival=1.0))
    _, outputs = step(scheduler)
    # vLLM v0: an admissible prompt wins the step; running decodes pause for it.
    assert scheduled_ids(outputs) == ["b"] and outputs.num_prefill_groups == 1
    _, outputs = step(scheduler)
    assert sorted(scheduled_ids(outputs)) == ["a", "b"] and outputs.num_prefill_groups == 0
    assert all(s.token_chunk_size == 1 for s in outputs.scheduled_seq_groups)


def test_decodes_are_listed_longest_first_while_the_queue_keeps_arrival_order():
    scheduler = make_scheduler(num_gpu_blocks=16, max_model_len=64)
    for request_id, prompt_len, arrival in (("short", 3, 0.0), ("long", 20, 1.0), ("mid", 9, 2.0)):
        scheduler.add_seq_group(make_group(request_id, prompt_len, max_tokens=30, arrival=arrival))
    step(scheduler)  # the three prompts
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["long", "mid", "short"]  # the kernel's longest programs first
    assert [g.request_id for g in scheduler.running] == ["short", "long", "mid"]
    # Preemption still follows arrival: the latest request ("mid") goes first, not the shortest.
    outputs, moves = _step_until_preemption(scheduler)
    assert moves.recomputed == ["mid"]
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_alloc_later_blocks_the_head_of_the_queue():
    scheduler = make_scheduler(num_gpu_blocks=6)
    scheduler.add_seq_group(make_group("big", 16, max_tokens=8))  # 4 blocks
    scheduler.add_seq_group(make_group("mid", 12, max_tokens=1, arrival=1.0))  # 3: LATER
    scheduler.add_seq_group(make_group("small", 4, max_tokens=1, arrival=2.0))  # 1 would fit
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["big"]
    assert [g.request_id for g in scheduler.waiting] == ["mid", "small"]  # FCFS: no overtaking
    assert scheduler.waiting[0].first_seq.status == SequenceStatus.WAITING
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_alloc_never_is_ignored_with_a_reason_and_the_queue_moves_on():
    scheduler = make_scheduler(num_gpu_blocks=4)
    huge = make_group("huge", 20)  # 5 blocks > 4 in the pool: AllocStatus.NEVER
    scheduler.add_seq_group(huge)
    scheduler.add_seq_group(make_group("ok", 4, max_tokens=1, arrival=1.0))
    _, outputs = step(scheduler)
    assert outputs.ignored_seq_groups == [huge]
    assert huge.first_seq.status == SequenceStatus.FINISHED_IGNORED
    assert SequenceStatus.get_finished_reason(huge.first_seq.status) == "abort"
    assert "NEVER" in huge.finish_message and "5 KV-cache blocks" in huge.finish_message
    assert scheduled_ids(outputs) == ["ok"]


def test_prompt_longer_than_max_model_len_is_ignored():
    scheduler = make_scheduler(max_model_len=32)
    group = make_group("long", 33)
    scheduler.add_seq_group(group)
    _, outputs = step(scheduler)
    assert outputs.ignored_seq_groups == [group] and not outputs.scheduled_seq_groups
    assert group.is_finished() and "max_model_len=32" in group.finish_message
    assert not scheduler.has_unfinished_seqs()


def test_more_sequences_than_max_num_seqs_is_ignored_not_stuck():
    scheduler = make_scheduler(max_num_seqs=2)
    group = make_group("wide", 4, n=3)
    scheduler.add_seq_group(group)
    _, outputs = step(scheduler)
    assert outputs.ignored_seq_groups == [group] and "max_num_seqs" in group.finish_message


def test_watermark_keeps_blocks_free_at_admission():
    scheduler = make_scheduler(num_gpu_blocks=200, max_model_len=1024)  # watermark 1 %: 2 blocks
    assert scheduler.block_manager.watermark_blocks == 2
    scheduler.add_seq_group(make_group("a", 197 * BLOCK_SIZE, max_tokens=1))  # leaves 3
    scheduler.add_seq_group(make_group("b", 2 * BLOCK_SIZE, max_tokens=1))  # 3 - 2 < 2: LATER
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["a"] and scheduler.waiting[0].request_id == "b"


# ================================================================== preemption
def _two_growing_requests(scheduler: Scheduler, max_tokens=8):
    # 4 GPU blocks of 4 tokens; two 4-token prompts grow until they need 3 blocks each.
    a = make_group("a", 4, max_tokens=max_tokens, arrival=0.0)
    b = make_group("b", 4, max_tokens=max_tokens, arrival=1.0)
    scheduler.add_seq_group(a)
    scheduler.add_seq_group(b)
    return a, b


def _step_until_preemption(scheduler: Scheduler):
    for _ in range(20):
        _, outputs, moves = step_moves(scheduler)
        if outputs.preempted:
            return outputs, moves
    raise AssertionError("no preemption happened")


def test_recompute_preemption_frees_the_latest_arrival():
    scheduler = make_scheduler(num_gpu_blocks=4)
    a, b = _two_growing_requests(scheduler)
    outputs, moves = _step_until_preemption(scheduler)
    assert outputs.preempted == 1 and moves.recomputed == ["b"]
    assert scheduler.num_cumulative_preemption == 1
    assert scheduled_ids(outputs) == ["a"] and not outputs.blocks_to_swap_out
    assert scheduler.waiting[0] is b and b.first_seq.status == SequenceStatus.WAITING
    assert b.first_seq.get_num_computed_tokens() == 0  # its KV cache is gone
    b_len = b.first_seq.get_len()
    assert b_len > 4  # it had generated tokens: they are recomputed as part of the prompt
    # When it comes back, prompt + generated tokens are prefilled in one go.
    while True:
        _, outputs = step(scheduler)
        if "b" in scheduled_ids(outputs):
            break
    (scheduled,) = [s for s in outputs.scheduled_seq_groups if s.seq_group is b]
    assert scheduled.token_chunk_size == b_len and outputs.num_prefill_groups >= 1
    run_to_completion(scheduler)
    assert a.first_seq.get_output_len() == b.first_seq.get_output_len() == 8
    assert_all_blocks_free(scheduler)


def test_swap_preemption_and_swap_in_restore_the_same_blocks():
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, preemption_mode="swap")
    a, b = _two_growing_requests(scheduler)
    outputs, moves = _step_until_preemption(scheduler)
    assert moves.swapped_out == ["b"] and list(scheduler.swapped) == [b]
    assert b.first_seq.status == SequenceStatus.SWAPPED
    assert len(outputs.blocks_to_swap_out) == 2  # its two GPU blocks -> two CPU blocks
    cpu_blocks = {cpu for _, cpu in outputs.blocks_to_swap_out}
    assert scheduler.block_manager.get_num_free_cpu_blocks() == 4 - 2
    computed = b.first_seq.get_num_computed_tokens()
    assert computed == b.first_seq.get_len() - 1  # swapping keeps the KV cache
    while True:
        _, outputs, moves = step_moves(scheduler)
        if moves.swapped_in:
            break
    assert moves.swapped_in == ["b"] and not outputs.blocks_to_swap_out
    assert {cpu for cpu, _ in outputs.blocks_to_swap_in} == cpu_blocks
    (scheduled,) = [s for s in outputs.scheduled_seq_groups if s.seq_group is b]
    assert scheduled.token_chunk_size == 1  # back as a decode, no recompute
    run_to_completion(scheduler)
    assert b.first_seq.get_output_len() == 8
    assert_all_blocks_free(scheduler)


def test_default_rule_recomputes_one_sequence_and_swaps_several():
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8)
    a = make_group("a", 4, max_tokens=8)
    b = make_group("b", 4, n=2, max_tokens=8, arrival=1.0)
    scheduler.add_seq_group(a)
    scheduler.add_seq_group(b)
    outputs, moves = _step_until_preemption(scheduler)
    assert moves.swapped_out == ["b"]  # two running sequences: swap (v0 rule)
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_forced_recompute_still_swaps_a_group_with_several_sequences():
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="recompute")
    scheduler.add_seq_group(make_group("a", 4, max_tokens=8))
    scheduler.add_seq_group(make_group("b", 4, n=2, max_tokens=8, arrival=1.0))
    outputs, moves = _step_until_preemption(scheduler)
    assert moves.swapped_out == ["b"]
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_swap_without_cpu_room_falls_back_to_recompute_for_one_sequence():
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=0, preemption_mode="swap")
    _two_growing_requests(scheduler)
    outputs, moves = _step_until_preemption(scheduler)
    assert moves.recomputed == ["b"] and not outputs.blocks_to_swap_out
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_swap_without_cpu_room_aborts_a_group_with_several_sequences():
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=0)
    a = make_group("a", 4, max_tokens=8)
    b = make_group("b", 4, n=2, max_tokens=8, arrival=1.0)
    scheduler.add_seq_group(a)
    scheduler.add_seq_group(b)
    for _ in range(20):
        _, outputs = step(scheduler)
        if outputs.ignored_seq_groups:
            break
    assert outputs.ignored_seq_groups == [b]
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in b.seqs)
    assert "CPU swap space" in b.finish_message
    assert b not in scheduler.running and b not in scheduler.swapped
    run_to_completion(scheduler)
    assert a.first_seq.get_output_len() == 8
    assert_all_blocks_free(scheduler)


def test_self_preemption_when_no_other_victim():
    # One request alone outgrows a 2-block pool: it preempts itself and comes back until
    # it can never fit again (then it is ignored with a reason): no crash, no hang.
    scheduler = make_scheduler(num_gpu_blocks=2)
    group = make_group("solo", 4, max_tokens=20)
    scheduler.add_seq_group(group)
    history = run_to_completion(scheduler)
    assert sum(o.preempted for o in history) >= 1
    assert group.first_seq.status == SequenceStatus.FINISHED_IGNORED
    assert group.finish_message
    assert_all_blocks_free(scheduler)


# ============================================================= priority policy
def test_priority_policy_orders_the_waiting_queue():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_seq_group(make_group("late-low", 4, priority=5, arrival=0.0))
    scheduler.add_seq_group(make_group("high", 4, priority=0, arrival=1.0))
    scheduler.add_seq_group(make_group("early-high", 4, priority=0, arrival=0.5))
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["early-high"]
    assert [g.request_id for g in scheduler.waiting] == ["high", "late-low"]


def _low_priority_fills_the_pool(policy):
    scheduler = make_scheduler(num_gpu_blocks=4, policy=policy)
    low = make_group("low", 8, priority=1, max_tokens=6)  # grows to 3 of the 4 blocks
    scheduler.add_seq_group(low)
    step(scheduler)
    step(scheduler)
    assert len(scheduler.block_manager.get_block_table(low.first_seq)) == 3
    high = make_group("high", 8, priority=0, max_tokens=2, arrival=2.0)  # needs 2 blocks
    scheduler.add_seq_group(high)
    return scheduler, low, high


def test_priority_preemption_recomputes_lower_priority_running_groups():
    scheduler, low, high = _low_priority_fills_the_pool("priority")
    _, outputs, moves = step_moves(scheduler)
    assert outputs.preempted == 1 and moves.recomputed == ["low"]
    assert low.first_seq.status == SequenceStatus.WAITING
    assert [g.request_id for g in scheduler.waiting] == ["high", "low"]
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["high"]
    run_to_completion(scheduler)
    assert low.first_seq.get_output_len() == 6
    assert_all_blocks_free(scheduler)


def test_fcfs_never_preempts_for_a_waiting_request():
    scheduler, low, high = _low_priority_fills_the_pool("fcfs")
    _, outputs = step(scheduler)
    assert outputs.preempted == 0 and scheduled_ids(outputs) == ["low"]
    assert scheduler.waiting[0] is high


# ============================================================== chunked prefill
def test_chunked_prefill_is_decode_first_and_cuts_the_prompt_to_the_budget():
    scheduler = make_scheduler(chunked=True, max_num_batched_tokens=16)
    decoder = make_group("dec", 4, max_tokens=10)
    scheduler.add_seq_group(decoder)
    step(scheduler)
    long = make_group("long", 40, max_tokens=2, arrival=1.0)
    scheduler.add_seq_group(long)
    chunks = []
    for _ in range(3):
        metadata, outputs = step(scheduler)
        by_id = {s.seq_group.request_id: s.token_chunk_size for s in outputs.scheduled_seq_groups}
        assert by_id["dec"] == 1  # the decode is never starved by the long prompt
        chunks.append(by_id["long"])
        assert outputs.num_batched_tokens == min(16, 1 + 40 - sum(chunks[:-1]))  # budget filled
        meta = {m.request_id: m for m in metadata}
        assert meta["long"].is_prompt and not meta["dec"].is_prompt
        assert meta["long"].do_sample == (sum(chunks) == 40)
        assert scheduled_ids(outputs)[0] == "long"  # prefills first in the flattened batch
    assert chunks == [15, 15, 10]
    assert long.first_seq.get_output_len() == 1  # sampled after its last chunk only
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_chunked_prefill_accepts_prompts_longer_than_the_token_budget():
    scheduler = make_scheduler(chunked=True, max_num_batched_tokens=8, max_model_len=64)
    group = make_group("long", 50, max_tokens=1)
    scheduler.add_seq_group(group)
    history = run_to_completion(scheduler)
    assert [o.num_batched_tokens for o in history] == [8] * 6 + [2]
    assert group.first_seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED


# =============================================================== prefix caching
def test_prefix_cache_hit_skips_cached_tokens_and_their_budget():
    scheduler = make_scheduler(caching=True)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks + 1 token
    first = make_group("first", prompt=prompt, max_tokens=1)
    scheduler.add_seq_group(first)
    _, outputs = step(scheduler)
    assert outputs.num_batched_tokens == 13
    second = make_group("second", prompt=prompt, max_tokens=1, arrival=1.0)
    scheduler.add_seq_group(second)
    metadata, outputs, _ = scheduler.schedule()
    (scheduled,) = outputs.scheduled_seq_groups
    cached = 3 * BLOCK_SIZE
    assert second.first_seq.get_num_computed_tokens() == cached
    assert scheduled.token_chunk_size == 13 - cached == outputs.num_batched_tokens
    table = scheduler.block_manager.get_block_table(second.first_seq)
    # Those 3 blocks are the first request's, reused from the prefix cache.
    assert all(scheduler.block_manager.gpu_allocator.get_block_info(b).cached for b in table[:3])
    assert [scheduler.block_manager.gpu_allocator.get_block_info(b).ref_count for b in table] == [1, 1, 1, 1]
    run_model(scheduler, outputs)
    assert scheduler.get_prefix_cache_hit_rate() > 0


def test_prefix_caching_off_computes_every_token():
    scheduler = make_scheduler(caching=False)
    prompt = list(range(1, 14))
    scheduler.add_seq_group(make_group("first", prompt=prompt, max_tokens=1))
    step(scheduler)
    scheduler.add_seq_group(make_group("second", prompt=prompt, max_tokens=1))
    _, outputs = step(scheduler)
    assert outputs.num_batched_tokens == 13


# ========================================================= fork, copy-on-write
def test_forked_sequences_copy_their_shared_last_block_on_write():
    scheduler = make_scheduler()
    group = make_group("pair", 5, n=2, max_tokens=4)  # blocks: [4 tokens][1 token]
    scheduler.add_seq_group(group)
    _, outputs = step(scheduler)
    assert outputs.scheduled_seq_groups[0].token_chunk_size == 5
    parent, child = group.seqs
    shared_last = scheduler.block_manager.get_block_table(parent)[-1]
    assert scheduler.block_manager.get_block_table(child)[-1] == shared_last
    metadata, outputs = step(scheduler)
    assert len(outputs.blocks_to_copy) == 1 and outputs.blocks_to_copy[0][0] == shared_last
    tables = metadata[0].block_tables
    assert tables[parent.seq_id][0] == tables[child.seq_id][0]  # full block stays shared
    assert tables[parent.seq_id][-1] != tables[child.seq_id][-1]
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_metadata_matches_the_block_manager():
    scheduler = make_scheduler()
    scheduler.add_seq_group(make_group("a", 9, max_tokens=3))
    metadata, outputs, _ = scheduler.schedule()
    (meta,) = metadata
    seq = outputs.scheduled_seq_groups[0].seq_group.first_seq
    assert meta.is_prompt and meta.do_sample and meta.token_chunk_size == 9
    assert meta.block_tables == {seq.seq_id: scheduler.block_manager.get_block_table(seq)}
    assert meta.seq_data[seq.seq_id] is seq.data


# ======================================================================== abort
def test_abort_in_every_state_frees_every_block():
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, preemption_mode="swap")
    a, b = _two_growing_requests(scheduler, max_tokens=30)
    _step_until_preemption(scheduler)
    waiting = make_group("w", 12, arrival=5.0)
    scheduler.add_seq_group(waiting)
    assert list(scheduler.running) == [a] and list(scheduler.swapped) == [b]
    assert scheduler.get_num_unfinished_seq_groups() == 3
    scheduler.abort_seq_group("unknown-id")  # ignored
    scheduler.abort_seq_group(iter(["a", "b", "w"]))
    assert not scheduler.has_unfinished_seqs()
    for group in (a, b, waiting):
        assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in group.seqs)
    assert_all_blocks_free(scheduler)


def test_abort_a_single_running_request_by_id():
    scheduler = make_scheduler()
    scheduler.add_seq_group(make_group("x", 5, max_tokens=10))
    scheduler.add_seq_group(make_group("y", 5, max_tokens=10))
    step(scheduler)
    scheduler.abort_seq_group("x")
    assert [g.request_id for g in scheduler.running] == ["y"]
    _, outputs = step(scheduler)
    assert scheduled_ids(outputs) == ["y"]


def test_swapped_groups_block_new_prompts_in_default_mode():
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, preemption_mode="swap")
    _two_growing_requests(scheduler, max_tokens=12)
    _step_until_preemption(scheduler)
    scheduler.add_seq_group(make_group("new", 4, max_tokens=1, arrival=5.0))
    while scheduler.swapped:
        _, outputs = step(scheduler)
        assert "new" not in scheduled_ids(outputs)  # v0: swapped requests go first
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_prompt_preempted_mid_chunk_is_swapped_and_resumes_its_chunks():
    # A two-sequence request (n=2) is preempted while its prompt is being chunked: v0's rule
    # swaps it (its max running sequences is 2); it comes back and finishes its prompt.
    scheduler = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=16, chunked=True,
                               max_num_batched_tokens=8, max_num_seqs=4)
    decoder = make_group("dec", 4, max_tokens=8)
    pair = make_group("pair", 40, n=2, max_tokens=3, arrival=1.0)
    scheduler.add_seq_group(decoder)
    step(scheduler)
    scheduler.add_seq_group(pair)
    outputs, moves = _step_until_preemption(scheduler)
    assert moves.swapped_out == ["pair"] and len(outputs.blocks_to_swap_out) == 10
    assert 0 < pair.first_seq.get_num_computed_tokens() < 40  # mid-prompt
    while True:
        metadata, outputs, moves = step_moves(scheduler)
        if moves.swapped_in:
            break
    (meta,) = [m for m in metadata if m.request_id == "pair"]
    assert meta.is_prompt and meta.token_chunk_size > 1  # it continues as a prompt chunk
    run_to_completion(scheduler)
    assert [s.get_output_len() for s in pair.seqs] == [3, 3]
    assert_all_blocks_free(scheduler)


def test_swapped_request_kept_out_by_the_watermark_alone_is_ignored_not_stuck():
    # 100 GPU blocks of one token, watermark 1 block. "b" (n=2) is swapped out holding 98
    # blocks; swapping it back needs 98 + 2 = 100 blocks, which leaves less than the
    # watermark even in an empty pool: LATER forever in vLLM v0. Here it is ignored.
    from minivllm.viz.sim import SimRequest, Simulator

    requests = [SimRequest("a", [1] * 9, [42]),
                SimRequest("b", [2] * 89, [13, 28], arrival_step=1)]
    sim = Simulator(SchedulerConfig(max_num_seqs=4, max_model_len=256),
                    CacheConfig(block_size=1, num_gpu_blocks=100, num_cpu_blocks=200), max_steps=500)
    result = sim.run(requests)
    assert result.results["a"].finish_reason == "stop"
    b = result.results["b"]
    assert b.status == "FINISHED_IGNORED" and "never fit back" in b.finish_message
    ignored_at = next(s for s in result.snapshots if "b" in s.ignored)
    assert not ignored_at.running and ignored_at.num_free_gpu_blocks == 100  # the GPU was idle
    assert_all_blocks_free(sim.scheduler)


# ============================================================ vLLM 0.6.3's signatures
def test_constructor_takes_vllm_positionals_and_refuses_what_minivllm_lacks():
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=8)
    scheduler = Scheduler(SchedulerConfig(), cache_config, None, 1, None)  # vLLM's order
    group = make_group("a", 5, max_tokens=1)
    scheduler.add_seq_group(group)
    metadata, outputs, allow_async_output_proc = scheduler.schedule()
    assert [m.request_id for m in metadata] == ["a"] and not allow_async_output_proc
    with pytest.raises(ValueError, match="LoRA"):
        Scheduler(SchedulerConfig(), cache_config, object())
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        Scheduler(SchedulerConfig(), cache_config, None, 2)
    with pytest.raises(ValueError, match="output_proc_callback"):
        Scheduler(SchedulerConfig(), cache_config, None, 1, lambda: None)
    with pytest.raises(TypeError):
        Scheduler(SchedulerConfig(), cache_config, None, 1, None, lambda: 0.0)  # clock is keyword-only


def test_budget_subtracts_a_counted_request_once_like_vllm():
    budget = SchedulingBudget(token_budget=10, max_num_seqs=4)
    budget.add_num_batched_tokens("a", 6)
    budget.add_num_batched_tokens("a", 6)  # counted once
    budget.add_num_seqs("a", 2)
    assert (budget.num_batched_tokens, budget.num_curr_seqs) == (6, 2)
    budget.subtract_num_batched_tokens("a", 6)
    budget.subtract_num_seqs("a", 2)
    budget.subtract_num_seqs("a", 2)  # no longer counted: a no-op
    budget.subtract_num_batched_tokens("never-added", 3)
    assert (budget.num_batched_tokens, budget.num_curr_seqs) == (0, 0)
    assert budget.can_schedule(num_new_tokens=10, num_new_seqs=4)
