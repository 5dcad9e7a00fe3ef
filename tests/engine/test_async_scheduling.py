"""Async scheduling (`async_scheduling`): the next multi-step run is scheduled and queued
while the current run's last step is still on the device.

The reference is the same engine with `async_scheduling=False`, which schedules each run
only after the host has processed the previous one: the tokens, logprobs, finish reasons and
reports must not change, only when the next run is queued. Each test also checks that runs
really were scheduled ahead and that every block came back.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.worker.multi_step_model_runner import MultiStepModelRunner

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from engine_test_checkpoints import assert_all_blocks_free, mixed_prompts


def make_engine(checkpoint_dirs, async_scheduling: bool, **kwargs) -> LLMEngine:
    """A 4-step engine on the CPU that records, per multi-step run, whether it continued the
    previous run (was scheduled ahead)."""
    path, _ = checkpoint_dirs["llama"]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8, num_scheduler_steps=4,
                                                   async_scheduling=async_scheduling, **kwargs))
    runner = engine.model_executor.driver_worker.multi_step_runner
    engine.runs_ahead = []
    original = runner.execute_model

    def recorded(metadata_list, kv_caches, num_steps, finished_requests_ids=None, continues_previous_run=False):
        engine.runs_ahead.append(continues_previous_run)
        return original(metadata_list, kv_caches, num_steps, finished_requests_ids, continues_previous_run)

    runner.execute_model = recorded
    return engine


run = checkpoints.run_to_completion


def assert_same_outputs(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].token_ids == expected[key].token_ids, key
        assert got[key].logprobs == expected[key].logprobs, key
        assert got[key].finish_reason == expected[key].finish_reason, key
        assert got[key].text == expected[key].text, key


def compare(checkpoint_dirs, prompts, params, **kwargs) -> LLMEngine:
    expected = run(make_engine(checkpoint_dirs, async_scheduling=False, **kwargs), prompts, params)
    engine = make_engine(checkpoint_dirs, async_scheduling=True, **kwargs)
    assert_same_outputs(run(engine, prompts, params), expected)
    assert_all_blocks_free(engine)
    return engine


def test_the_next_run_is_queued_before_the_last_step_is_processed(checkpoint_dirs):
    """The contract: run 2's forward passes are launched while the engine still has run 1's
    last output to process, so the device never waits for the host between runs."""
    engine = make_engine(checkpoint_dirs, async_scheduling=True)
    seen = checkpoints.launches_seen_by_each_output(engine)
    engine.add_request("0", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=9))
    engine.step()  # the prefill: token 1
    engine.step()  # run 1 (tokens 2-5); run 2 (tokens 6-9) is queued before token 5 is processed
    assert engine.runs_ahead == [False, True]
    assert seen[1:] == [5, 5, 5, 9]
    engine.step()  # run 2's outputs: nothing more is queued (the request ends with it)
    assert engine.runs_ahead == [False, True]
    assert seen[5:] == [9, 9, 9, 9]
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=17, logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=19, seed=11),
    SamplingParams(temperature=0.8, max_tokens=21, seed=3, top_k=5, top_p=0.9, logprobs=3,
                   frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_tokens=14),
], ids=["greedy", "logprobs", "seeded", "everything-on-the-device"])
def test_tokens_logprobs_and_reports_match_the_engine_without_it(checkpoint_dirs, params):
    """Seeds, min_tokens and penalties follow the token in flight: a run scheduled ahead
    samples exactly what a run scheduled after the host caught up would."""
    engine = compare(checkpoint_dirs, mixed_prompts(4, seed=5), params)
    assert any(engine.runs_ahead)


def test_requests_ending_inside_a_run_scheduled_ahead(checkpoint_dirs):
    """Stop tokens and stop strings end a request inside a run that was already queued: its
    later rows are thrown away, it is reported once, with the same tokens and text."""
    prompts = mixed_prompts(6, seed=2)
    tokenizer = checkpoints.build_tokenizer()
    reference = run(make_engine(checkpoint_dirs, async_scheduling=False), prompts,
                    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    # Stop on tokens each request really generates, at different steps of different runs.
    params = []
    for i, prompt in enumerate(prompts):
        tokens = reference[str(i)].token_ids
        stop_at = tokens[5 + 3 * i] if 5 + 3 * i < len(tokens) else tokens[-1]
        text = tokenizer.decode([stop_at]).strip()
        if i % 2 or not text:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_at], ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop=[text], ignore_eos=True))
    engine = compare(checkpoint_dirs, prompts, params)
    assert any(engine.runs_ahead)


def test_abort_and_add_while_a_run_is_scheduled_ahead(checkpoint_dirs):
    """Between two steps a run may already be queued: aborting one of its requests returns
    every block and reports nothing for it; a request added then runs after it."""
    engine = make_engine(checkpoint_dirs, async_scheduling=True)
    prompts = mixed_prompts(3, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy)
    engine.step()
    engine.step()
    assert engine._scheduled_ahead is not None  # a run is queued between the two calls
    engine.abort_request("1")
    engine.add_request("late", {"prompt_token_ids": prompts[1]}, greedy)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id != "1"
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert set(finished) == {"0", "2", "late"}
    alone = run(make_engine(checkpoint_dirs, async_scheduling=False), [prompts[1]], greedy)
    assert finished["late"] == alone["0"].token_ids
    assert_all_blocks_free(engine)


def test_nothing_is_scheduled_ahead_while_prompts_wait(checkpoint_dirs):
    """A waiting prompt must be admitted by a normal schedule (its prefill cannot be queued
    behind a decode run without the host), so no run is scheduled ahead meanwhile."""
    engine = make_engine(checkpoint_dirs, async_scheduling=True, max_num_seqs=2)
    run(engine, mixed_prompts(5, seed=8), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert engine.runs_ahead.count(True) < len(engine.runs_ahead)
    assert_all_blocks_free(engine)


def test_preemption_with_few_blocks(checkpoint_dirs):
    """When blocks run short nothing is scheduled ahead (it could only preempt): the engine
    falls back to the usual schedule, which preempts, and the outputs are unchanged."""
    prompts = mixed_prompts(6, seed=3, max_len=30)
    compare(checkpoint_dirs, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
            num_gpu_blocks_override=24)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_tokens=st.lists(st.integers(1, 20), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_any_mix_of_lengths_gives_the_same_outputs(checkpoint_dirs, max_tokens, seed):
    """Requests of any length end in any step of any run, some on their in-flight token."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(rng.randint(1, 12))] for _ in max_tokens]
    params = [SamplingParams(temperature=0.7, seed=seed + i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    compare(checkpoint_dirs, prompts, params)


def test_async_scheduling_needs_multi_step(checkpoint_dirs):
    path, _ = checkpoint_dirs["llama"]
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(model=path, device="cpu", num_scheduler_steps=1, async_scheduling=True).create_engine_config()
    config = EngineArgs(model=path, device="cpu", num_scheduler_steps=4).create_engine_config()
    assert config.scheduler_config.async_scheduling  # on by default with multi-step
    assert not EngineArgs(model=path, device="cpu").create_engine_config().scheduler_config.async_scheduling


def test_a_run_that_cannot_continue_is_refused():
    """The worker's guard: a run marked as continuing one that never ran raises."""
    runner = MultiStepModelRunner.__new__(MultiStepModelRunner)
    runner._last_run = None
    with pytest.raises(RuntimeError, match="previous multi-step run"):
        runner._continue_previous_run([0], None, None, None)


def test_a_step_failing_after_the_next_run_was_queued_loses_no_token(checkpoint_dirs):
    """A streaming callback that raises on the last output of a run, after the next run was
    queued from that output's tokens: the queued run is dropped, and the tokens are the ones
    of an engine whose callbacks never failed."""
    prompts = mixed_prompts(2, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = run(make_engine(checkpoint_dirs, async_scheduling=False), prompts, greedy)
    engine = make_engine(checkpoint_dirs, async_scheduling=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy)
    calls = []

    def fails_on_the_last_output(outputs):
        calls.append(1)
        if len(calls) == 3:  # run 1's fourth (last) output: run 2 is already queued
            raise RuntimeError("a client callback failed")

    engine.step()  # the prefills
    engine.step(on_model_step=fails_on_the_last_output)
    assert engine.runs_ahead == [False, True]
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in expected.items()}
    assert_all_blocks_free(engine)
