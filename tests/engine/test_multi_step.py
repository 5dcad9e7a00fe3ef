"""Multi-step scheduling (`num_scheduler_steps`): several decode steps per `schedule()`.

The reference is transformers' greedy `generate` (as in test_parity.py) and, for what
transformers cannot express (stop tokens, sampling, logprobs), the same engine run one
step at a time. Each test also checks that multi-step runs really happened and that every
block came back.
"""

import random

import pytest
import torch

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from engine_test_checkpoints import assert_all_blocks_free, mixed_prompts


def make_engine(checkpoint_dirs, family="llama", device="cpu", **kwargs) -> LLMEngine:
    path, _ = checkpoint_dirs[family]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, device=device, block_size=8, **kwargs))
    engine.multi_step_runs = []
    worker = engine.model_executor.driver_worker
    if not hasattr(worker, "multi_step_runner"):  # num_scheduler_steps=1: the plain worker
        return engine
    runner = worker.multi_step_runner
    original = runner.execute_model

    def counted(metadata_list, kv_caches, num_steps, *args):
        engine.multi_step_runs.append((len(metadata_list), num_steps))
        return original(metadata_list, kv_caches, num_steps, *args)

    runner.execute_model = counted
    return engine


run = checkpoints.run_to_completion


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_transformers_with_several_steps_per_schedule(checkpoint_dirs, family):
    """Lengths 3..17 are no multiple of 4: requests stop in the middle of a multi-step run."""
    _, hf_model = checkpoint_dirs[family]
    prompts = mixed_prompts(7, seed=5)
    max_tokens = [3 + 2 * i for i in range(len(prompts))]
    engine = make_engine(checkpoint_dirs, family, num_scheduler_steps=4)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    results = run(engine, prompts, params)
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        assert results[str(i)].token_ids == checkpoints.hf_greedy(hf_model, prompt, m), f"prompt {i}"
        assert results[str(i)].finish_reason == "length"
    assert engine.multi_step_runs and max(steps for _, steps in engine.multi_step_runs) == 4
    # 1 prefill step, then at most ceil(16 / 4) runs for the longest request (17 tokens).
    assert engine.step_counter <= 1 + 4 + 1
    assert_all_blocks_free(engine)


def test_triton_backend_advances_each_step_in_one_kernel(checkpoint_dirs):
    """The "triton" backend (on the GPU when there is one, else in Triton's interpreter) builds
    each step's inputs with `kernels/advance_step.py`; requests that run out of reserved slots
    mid-run (inactive rows) keep the output transformers gives."""
    _, hf_model = checkpoint_dirs["llama"]
    prompts = mixed_prompts(4, seed=27)
    max_tokens = [2, 5, 6, 9]
    expected = [checkpoints.hf_greedy(hf_model, prompt, m) for prompt, m in zip(prompts, max_tokens)]
    assert min(checkpoints.greedy_margin(hf_model, p, e) for p, e in zip(prompts, expected)) > 1e-3
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=4, attention_backend="triton",
                         device="cuda" if torch.cuda.is_available() else "cpu")
    assert engine.model_executor.driver_worker.multi_step_runner.advance.backend == "triton"
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    results = run(engine, prompts, params)
    for i in range(len(prompts)):
        assert results[str(i)].token_ids == expected[i], f"prompt {i}"
    assert engine.multi_step_runs
    assert_all_blocks_free(engine)


def test_stop_token_in_the_middle_of_a_run_cuts_the_output_there(checkpoint_dirs):
    """A stop token sampled at step 2 of 4: the tokens computed after it are dropped."""
    prompts = mixed_prompts(5, seed=6)
    single = run(make_engine(checkpoint_dirs), prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    # Stop at each request's 6th greedy token (the same id may occur earlier: fine, both
    # engines see the same tokens).
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                             stop_token_ids=[single[str(i)].token_ids[5]]) for i in range(len(prompts))]
    expected = run(make_engine(checkpoint_dirs), prompts, params)
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=4)
    got = run(engine, prompts, params)
    for i in range(len(prompts)):
        assert got[str(i)].token_ids == expected[str(i)].token_ids
        assert got[str(i)].finish_reason == "stop" and len(got[str(i)].token_ids) <= 6
    assert engine.multi_step_runs
    assert_all_blocks_free(engine)


def test_preemption_and_chunked_prefill_with_multi_step(checkpoint_dirs):
    """A pool too small for everyone: lookahead slots must never cost a preemption loop."""
    _, hf_model = checkpoint_dirs["llama"]
    prompts = mixed_prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for extra in ({"num_gpu_blocks_override": 12},
                  {"num_gpu_blocks_override": 9, "enable_chunked_prefill": True, "max_num_batched_tokens": 24,
                   "max_num_seqs": 4}):
        engine = make_engine(checkpoint_dirs, num_scheduler_steps=8, **extra)
        results = run(engine, prompts, params)
        for i, prompt in enumerate(prompts):
            assert results[str(i)].token_ids == checkpoints.hf_greedy(hf_model, prompt, 24), (extra, i)
        assert engine.scheduler.num_cumulative_preemption > 0
        assert engine.multi_step_runs
        assert_all_blocks_free(engine)


def test_lookahead_slots_stop_at_max_tokens_and_max_model_len(checkpoint_dirs):
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=8, max_model_len=40)
    engine.add_request("short", {"prompt_token_ids": [5] * 10}, SamplingParams(temperature=0.0, max_tokens=3,
                                                                               ignore_eos=True))
    engine.add_request("long", {"prompt_token_ids": [6] * 35}, SamplingParams(temperature=0.0, max_tokens=100,
                                                                              ignore_eos=True))
    engine.step()  # both prefills; each has its first token
    metadata_list, _, _ = engine.scheduler.schedule()
    lookahead = {m.request_id: m.num_lookahead_slots for m in metadata_list}
    # "short" may generate 2 more tokens, "long" 4 more (36 of 40 tokens held).
    assert lookahead == {"short": 1, "long": 3}
    block_manager = engine.scheduler.block_manager
    for group in engine.scheduler.running:
        seq = group.first_seq
        table = block_manager.get_block_table(seq)
        assert len(table) == -(-(seq.get_len() + lookahead[group.request_id]) // 8)


def test_logprobs_penalties_seeds_and_min_tokens_stay_on_the_device(checkpoint_dirs):
    """Logprobs, penalties, seeds and min_tokens are computed on the device: such batches run
    multi-step and give the single-step engine's tokens and logprobs."""
    prompts = mixed_prompts(3, seed=7)
    for params in (SamplingParams(temperature=0.0, max_tokens=9, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3),
                   SamplingParams(temperature=0.9, max_tokens=9, seed=11),
                   SamplingParams(temperature=0.8, max_tokens=9, seed=3, top_k=5, top_p=0.9, logprobs=3,
                                  frequency_penalty=0.5, presence_penalty=0.3, min_tokens=6)):
        expected = run(make_engine(checkpoint_dirs), prompts, params)
        engine = make_engine(checkpoint_dirs, num_scheduler_steps=4)
        got = run(engine, prompts, params)
        assert engine.multi_step_runs
        for i in range(len(prompts)):
            assert got[str(i)].token_ids == expected[str(i)].token_ids
            assert_same_logprobs(got[str(i)].logprobs, expected[str(i)].logprobs)
        assert_all_blocks_free(engine)


def assert_same_logprobs(got, expected):
    """The same candidates, ranks and text at every position, and the same values up to fp32
    rounding: the two engines batch the rows differently, and a CPU's vector kernels may then sum
    a row's softmax in another order (a last-bit difference)."""
    if expected is None:
        assert got is None
        return
    assert len(got) == len(expected)
    for position, (g, e) in enumerate(zip(got, expected)):
        assert g.keys() == e.keys(), position
        for token in g:
            assert (g[token].rank, g[token].decoded_token) == (e[token].rank, e[token].decoded_token), position
            assert g[token].logprob == pytest.approx(e[token].logprob, rel=1e-6, abs=1e-7), position


def test_random_sampling_runs_multi_step_and_follows_temperature(checkpoint_dirs):
    """Unseeded sampling stays on the device; at a tiny temperature it is greedy."""
    prompts = mixed_prompts(4, seed=8)
    greedy = run(make_engine(checkpoint_dirs), prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=4)
    cold = run(engine, prompts, SamplingParams(temperature=1e-4, max_tokens=10, ignore_eos=True))
    assert engine.multi_step_runs
    assert all(cold[k].token_ids == greedy[k].token_ids for k in greedy)
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=4)
    hot = run(engine, prompts, SamplingParams(temperature=5.0, max_tokens=10, ignore_eos=True))
    assert any(hot[k].token_ids != greedy[k].token_ids for k in greedy)
    assert all(len(hot[k].token_ids) == 10 for k in hot)
    assert_all_blocks_free(engine)


def test_abort_during_multi_step_returns_every_block(checkpoint_dirs):
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=8)
    rng = random.Random(9)
    for i in range(4):
        prompt = [rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(5 + 3 * i)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.multi_step_runs
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_num_scheduler_steps_must_be_positive(checkpoint_dirs):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_engine(checkpoint_dirs, num_scheduler_steps=0)


def test_every_step_is_queued_before_the_engine_processes_the_first(checkpoint_dirs):
    """The overlap contract: the whole run is queued on the device before the host processes
    step 0's outputs, so the GPU never waits for the host within a run. (Between runs:
    tests/engine/test_async_scheduling.py.)"""
    engine = make_engine(checkpoint_dirs, num_scheduler_steps=4, async_scheduling=False)
    seen = checkpoints.launches_seen_by_each_output(engine)
    engine.add_request("0", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=9))
    engine.step()  # the prefill: one forward, then its outputs
    assert seen == [1]
    engine.step()  # a run of 4 decode steps: every output arrives after all 4 launches
    assert engine.multi_step_runs == [(1, 4)]
    assert seen[1:] == [5, 5, 5, 5]
