"""The model-free simulator: its stand-in model, bookkeeping, metrics and the static baseline.

References are hand-computed from the workload (lengths, arrivals) and from the definition
of static batching (a batch runs until its longest request ends), not from our own output.
"""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.viz.sim import (
    EOS_TOKEN_ID,
    SimRequest,
    Simulator,
    StepCostModel,
    make_workload,
    simulate_static_batching,
)

BLOCK_SIZE = 4


def simulator(num_gpu_blocks=256, num_cpu_blocks=0, **scheduler_kwargs) -> Simulator:
    scheduler_kwargs.setdefault("max_model_len", 256)
    return Simulator(SchedulerConfig(**scheduler_kwargs),
                     CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks,
                                 num_cpu_blocks=num_cpu_blocks))


def request(request_id, prompt_len, *output_lens, **kwargs) -> SimRequest:
    return SimRequest(request_id, list(range(1, prompt_len + 1)), list(output_lens), **kwargs)


def test_stand_in_model_emits_eos_at_the_target_length():
    sim = simulator()
    result = sim.run([request("a", 5, 3), request("b", 9, 1)])
    for rid, target in (("a", 3), ("b", 1)):
        outcome = result.results[rid]
        assert outcome.finish_reason == "stop" and outcome.num_output_tokens == target
        seq = sim._groups[rid].first_seq
        assert seq.get_output_token_ids()[-1] == EOS_TOKEN_ID
        assert EOS_TOKEN_ID not in seq.get_output_token_ids()[:-1]


def test_ttft_and_latency_in_steps_without_contention():
    # Both prompts fit in one prefill step, then decode together: a token per step.
    result = simulator().run([request("a", 5, 4), request("b", 6, 2)])
    a, b = result.results["a"], result.results["b"]
    assert a.ttft_steps == b.ttft_steps == 1
    assert a.latency_steps == 4 and b.latency_steps == 2
    assert result.stats.num_steps == 4
    assert result.stats.num_generated_tokens == 6
    assert result.stats.throughput == pytest.approx(6 / 4)


def test_one_snapshot_per_step_and_memory_adds_up():
    result = simulator(num_gpu_blocks=32).run(make_workload(6, (3, 12), (1, 8), seed=3))
    assert [s.step for s in result.snapshots] == list(range(len(result.snapshots)))
    for snapshot in result.snapshots:
        assert snapshot.num_used_gpu_blocks + snapshot.num_free_gpu_blocks == 32
        used = {b for tables in snapshot.block_tables.values() for t in tables.values() for b in t}
        assert len(used) <= snapshot.num_used_gpu_blocks
    finished = [rid for s in result.snapshots for rid in s.finished]
    assert sorted(finished) == sorted(result.results)


def test_arrivals_wait_for_their_step():
    result = simulator().run([request("early", 4, 3), request("late", 4, 2, arrival_step=5)])
    for snapshot in result.snapshots[:5]:
        assert "late" not in snapshot.waiting + snapshot.running
    assert result.results["late"].arrival_step == 5
    assert result.results["late"].ttft_steps == 1  # nothing else is running at step 5


def test_abort_at_a_step():
    result = simulator().run([request("a", 4, 20, abort_step=3), request("b", 4, 5)])
    a = result.results["a"]
    assert a.finish_reason == "abort" and a.finish_step == 3 and a.num_output_tokens == 3
    assert result.snapshots[3].aborted == ["a"]
    assert result.results["b"].finish_reason == "stop"


def test_n_greater_than_one_forks_with_per_sequence_targets():
    sim = simulator()
    result = sim.run([request("pair", 6, 2, 5)])
    outcome = result.results["pair"]
    assert outcome.seq_output_lens == [2, 5] and outcome.num_output_tokens == 7
    assert outcome.seq_statuses == ["FINISHED_STOPPED"] * 2
    assert result.snapshots[0].batch[0].num_tokens == 6  # one prompt for both
    assert len(result.snapshots[1].batch[0].seq_ids) == 2


def test_max_tokens_and_max_model_len_cap_the_output():
    sim = simulator(max_model_len=10, max_num_batched_tokens=10, max_num_seqs=4)
    result = sim.run([request("capped", 4, 50, max_tokens=3), request("long", 8, 50)])
    assert result.results["capped"].num_output_tokens == 3
    assert result.results["long"].num_output_tokens == 2  # 8 + 2 = max_model_len
    assert {r.finish_reason for r in result.results.values()} == {"length"}


def test_ignored_requests_get_a_reason():
    result = simulator(max_model_len=16, max_num_batched_tokens=16, max_num_seqs=4).run([request("huge", 40, 3)])
    outcome = result.results["huge"]
    assert outcome.status == "FINISHED_IGNORED" and "exceeds the limit" in outcome.finish_message


def test_a_run_that_cannot_finish_raises():
    sim = Simulator(SchedulerConfig(max_model_len=256), CacheConfig(block_size=4, num_gpu_blocks=64),
                    max_steps=3)
    with pytest.raises(RuntimeError, match="did not finish"):
        sim.run([request("a", 4, 10)])


def test_cost_model_time_is_the_sum_of_step_costs():
    cost = StepCostModel(step_overhead_ms=2.0, ms_per_token=0.5)
    sim = Simulator(SchedulerConfig(max_model_len=256), CacheConfig(block_size=4, num_gpu_blocks=64),
                    cost_model=cost)
    result = sim.run([request("a", 10, 3)])
    # prefill of 10 tokens, then two decodes of 1 token
    expected = (2.0 + 0.5 * 10) + 2 * (2.0 + 0.5 * 1)
    assert result.stats.total_ms == pytest.approx(expected)
    assert result.results["a"].ttft_ms == pytest.approx(7.0)
    assert result.stats.mean_itl_ms == pytest.approx(2.5)


def test_make_workload_is_deterministic_and_shares_prefixes():
    first = make_workload(5, (4, 8), (2, 6), arrival_every=3.0, shared_prefix_len=6, seed=1)
    assert first == make_workload(5, (4, 8), (2, 6), arrival_every=3.0, shared_prefix_len=6, seed=1)
    assert first != make_workload(5, (4, 8), (2, 6), arrival_every=3.0, shared_prefix_len=6, seed=2)
    assert len({tuple(r.prompt_token_ids[:6]) for r in first}) == 1
    assert all(10 <= r.prompt_len <= 14 and 2 <= r.output_lens[0] <= 6 for r in first)
    arrivals = [r.arrival_step for r in first]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 0
    with pytest.raises(ValueError):
        make_workload(2, n=0)


def test_static_batching_runs_each_batch_until_its_longest_request():
    lengths = [2, 9, 3, 4, 1]
    requests = [request(str(i), 4, n) for i, n in enumerate(lengths)]
    result = simulate_static_batching(requests, batch_size=2)
    # batches {2, 9}, {3, 4}, {1}: 9 + 4 + 1 steps
    assert result.stats.num_steps == 14
    assert result.stats.slot_utilization == pytest.approx(sum(lengths) / (2 * 14))
    idle = sum(1 for s in result.snapshots for e in s.batch if e.phase == "idle")
    assert idle == (9 - 2) + (4 - 3)  # the padding the short requests leave behind
    assert result.results["2"].first_token_step == 9  # its batch starts after the first one
    assert result.results["1"].latency_steps == 9


def test_continuous_batching_beats_static_on_a_skewed_workload():
    requests = make_workload(24, prompt_len=(4, 16), output_len=(1, 40), seed=0)
    static = simulate_static_batching(requests, batch_size=4)
    continuous = simulator(max_num_seqs=4).run(requests)
    assert continuous.stats.num_generated_tokens == static.stats.num_generated_tokens
    assert continuous.stats.slot_utilization > static.stats.slot_utilization
    assert continuous.stats.num_steps < static.stats.num_steps


def test_static_batching_rejects_what_it_does_not_model():
    with pytest.raises(ValueError):
        simulate_static_batching([request("a", 4, 2, 3)], batch_size=2)
    with pytest.raises(ValueError):
        simulate_static_batching([request("a", 4, 2)], batch_size=0)


def test_manual_stepping_and_token_times():
    sim = Simulator(SchedulerConfig(max_model_len=256), CacheConfig(block_size=4, num_gpu_blocks=64),
                    cost_model=StepCostModel(step_overhead_ms=1.0, ms_per_token=1.0))
    sim.add_request(request("a", 4, 3))
    first = sim.step()
    assert first.step == 0 and first.batch[0].phase == "prefill" and first.time == pytest.approx(5.0)
    sim.add_request(request("b", 2, 5))  # arrives at step 1: a prefill step, "a" waits
    with pytest.raises(ValueError, match="already used"):
        sim.add_request(request("a", 4, 3))
    assert sim.step().batch[0].request_id == "b"
    assert sim.abort(["b", "unknown"]) == ["b"]
    assert sim.step().aborted == ["b"]
    while sim.scheduler.has_unfinished_seqs():
        sim.step()
    result = sim.result()
    assert result.results["a"].token_steps == [0, 2, 3]
    # step costs: 1 + 4 (prefill a), 1 + 2 (prefill b), then decodes of 1 token: 2 ms each
    assert result.token_times_ms("a") == pytest.approx([5.0, 10.0, 12.0])
    assert result.max_itl_ms("a") == pytest.approx(5.0)  # the gap with b's prefill in it
