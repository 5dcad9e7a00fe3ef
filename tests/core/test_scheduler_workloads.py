"""Hypothesis-generated workloads through the simulator: the scheduler's invariants.

Each example is a small random workload (lengths, arrivals, priorities, aborts, n > 1,
max_tokens, prompts too long to ever fit) on a tiny block pool, with both preemption modes,
chunked prefill on or off, prefix caching on or off, FCFS or priority, 1-4 scheduler steps
(lookahead slots). The real Scheduler
and BlockSpaceManager run it to the end; then we check, for every step and at the end:

- every request ends finished (stop / length / abort) and an ignored or scheduler-aborted
  one carries a reason; a request that ran to completion produced exactly its expected tokens;
- no group is in two queues;
- budgets (max_num_seqs, max_num_batched_tokens) are never exceeded in any step;
- swap-outs never exceed the CPU pool; after the run every GPU and CPU block is free;
- each step lists its decodes longest first (the order the decode kernel launches them in).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.step_observer import StepObserver
from minivllm.viz.sim import SimRequest, Simulator

NUM_WORKLOADS = 500
MAX_STEPS = 3_000  # far above what a small workload needs: hitting it means a hang


@st.composite
def configs(draw):
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(8, 48))
    max_num_seqs = draw(st.integers(1, 6))
    low = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(low, low + 48)),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        preemption_mode=draw(st.sampled_from([None, "recompute", "swap"])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        # Multi-step: lookahead slots reserved ahead of the one token a sim step produces.
        num_scheduler_steps=draw(st.integers(1, 4)),
    )
    cache_config = CacheConfig(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        num_gpu_blocks=draw(st.integers(1, 24)),
        num_cpu_blocks=draw(st.integers(0, 16)),
        enable_prefix_caching=draw(st.booleans()),
    )
    return scheduler_config, cache_config


@st.composite
def requests(draw, max_model_len: int):
    num_requests = draw(st.integers(1, 8))
    # A shared "system prompt" and a tiny vocabulary make prefix-cache hits common.
    vocab = st.integers(1, 3)
    system_prompt = draw(st.lists(vocab, max_size=16))
    result = []
    for i in range(num_requests):
        prefix = system_prompt if draw(st.booleans()) else []
        prompt = prefix + draw(st.lists(vocab, min_size=1, max_size=max_model_len + 4))
        n = draw(st.integers(1, 3))
        result.append(SimRequest(
            request_id=str(i),
            prompt_token_ids=prompt,
            output_lens=draw(st.lists(st.integers(1, 20), min_size=n, max_size=n)),
            arrival_step=draw(st.integers(0, 12)),
            priority=draw(st.integers(0, 2)),
            max_tokens=draw(st.none() | st.integers(1, 16)),
            abort_step=draw(st.none() | st.integers(0, 40)),
        ))
    return result


@st.composite
def workloads(draw):
    scheduler_config, cache_config = draw(configs())
    return scheduler_config, cache_config, draw(requests(scheduler_config.max_model_len))


def expected_output_len(request: SimRequest, target: int, max_model_len: int) -> int:
    """What the stand-in model must have produced for one sequence that ran to the end."""
    limit = target if request.max_tokens is None else min(target, request.max_tokens)
    return min(limit, max(1, max_model_len - request.prompt_len))


def check_steps(result, scheduler_config, cache_config) -> None:
    for snapshot in result.snapshots:
        queues = snapshot.waiting + snapshot.running + snapshot.swapped
        assert len(queues) == len(set(queues)), f"step {snapshot.step}: a group in two queues"
        assert snapshot.num_batched_tokens == sum(e.num_tokens for e in snapshot.batch)
        assert snapshot.num_batched_tokens <= scheduler_config.max_num_batched_tokens
        assert snapshot.num_scheduled_seqs <= scheduler_config.max_num_seqs
        swapped_out_to = [cpu for _, cpu in snapshot.blocks_to_swap_out]
        assert len(swapped_out_to) == len(set(swapped_out_to))
        assert all(0 <= b < cache_config.num_cpu_blocks for b in swapped_out_to)
        assert 0 <= snapshot.num_swapped_blocks <= cache_config.num_cpu_blocks
        assert 0 <= snapshot.num_used_gpu_blocks <= cache_config.num_gpu_blocks
        assert not (snapshot.blocks_to_swap_in and snapshot.blocks_to_swap_out)
        assert set(snapshot.swapped) == set(snapshot.cpu_block_tables)
        # Read from the queues by the recorder; they add up to the scheduler's own count.
        assert len(snapshot.preempted_by_recompute) + len(snapshot.preempted_by_swap) == snapshot.preempted


class DecodesLongestFirst(StepObserver):
    """Checks every batch as scheduled: its decodes' lengths never grow along the batch."""

    def on_scheduled(self, engine, scheduler_outputs) -> None:
        decodes = scheduler_outputs.scheduled_seq_groups[scheduler_outputs.num_prefill_groups:]
        lens = [s.seq_group.seqs[0].get_len() for s in decodes]
        assert lens == sorted(lens, reverse=True), f"decodes not longest first: {lens}"


def check_results(result, workload, max_model_len) -> None:
    assert set(result.results) == {r.request_id for r in workload}
    for request in workload:
        outcome = result.results[request.request_id]
        assert outcome.finish_reason in ("stop", "length", "abort"), outcome
        assert all(s.startswith("FINISHED") for s in outcome.seq_statuses), outcome
        if outcome.status in ("FINISHED_IGNORED", "FINISHED_ABORTED"):
            assert outcome.finish_message, outcome
        # Sequences that ran to their end produced exactly the expected tokens (preemption,
        # swapping and recompute lose none and add none).
        for status, produced, target in zip(outcome.seq_statuses, outcome.seq_output_lens,
                                            request.output_lens):
            if status in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"):
                assert produced == expected_output_len(request, target, max_model_len), (outcome, request)
        if outcome.finish_reason != "abort" and outcome.status != "FINISHED_IGNORED":
            assert len(outcome.seq_statuses) == request.n  # every sibling was forked


@settings(max_examples=NUM_WORKLOADS, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_keep_the_scheduler_invariants(workload):
    scheduler_config, cache_config, reqs = workload
    simulator = Simulator(scheduler_config, cache_config, max_steps=MAX_STEPS)
    simulator.engine.add_step_observer(DecodesLongestFirst())
    result = simulator.run(reqs)
    check_steps(result, scheduler_config, cache_config)
    check_results(result, reqs, scheduler_config.max_model_len)
    scheduler = simulator.scheduler
    assert not scheduler.has_unfinished_seqs()
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == cache_config.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == cache_config.num_cpu_blocks
    assert not bm.block_tables
