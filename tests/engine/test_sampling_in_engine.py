"""Sampling through the whole engine: beam search vs transformers, parallel sampling and beam
search sharing blocks (copy-on-write), seeded reproducibility, logprobs vs the model's own."""

import random

import pytest
import torch

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.viz.snapshot import SnapshotRecorder

BLOCK_SIZE = 8


def make_engine(checkpoint_dirs, family="llama", **kwargs) -> LLMEngine:
    path, _ = checkpoint_dirs[family]
    return LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=BLOCK_SIZE, **kwargs))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(length)]


def num_used_blocks(engine: LLMEngine) -> int:
    return engine.cache_config.num_gpu_blocks - engine.scheduler.block_manager.get_num_free_gpu_blocks()


@pytest.mark.parametrize("beam_width,num_return,length_penalty", [(2, 2, 1.0), (4, 4, 1.0), (4, 2, 0.5)])
def test_beam_search_returns_transformers_beams(checkpoint_dirs, beam_width, num_return, length_penalty):
    _, hf_model = checkpoint_dirs["llama"]
    max_tokens = 8
    prompts = [random_prompt(n, seed=n) for n in (5, 13)]
    params = SamplingParams(n=num_return, best_of=beam_width, use_beam_search=True, temperature=0.0,
                            max_tokens=max_tokens, ignore_eos=True, length_penalty=length_penalty)
    engine = make_engine(checkpoint_dirs)
    outputs = run(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt]), do_sample=False, num_beams=beam_width, num_return_sequences=num_return,
                max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, length_penalty=length_penalty,
                early_stopping=False,
            )[:, len(prompt):].tolist()
        assert [c.token_ids for c in outputs[str(i)].outputs] == expected
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_beam_search_cumulative_logprobs_are_the_models(checkpoint_dirs):
    """Each returned beam's cumulative logprob is the sum of its tokens' log-softmax under
    transformers' forward pass (the quantity beam search ranks by)."""
    _, hf_model = checkpoint_dirs["llama"]
    prompt = random_prompt(6, seed=7)
    params = SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=5, ignore_eos=True)
    output = run(make_engine(checkpoint_dirs), {"b": (prompt, params)})["b"]
    for completion in output.outputs:
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(ids).logits[0].float(), -1)
        positions = range(len(prompt) - 1, ids.shape[1] - 1)
        expected = sum(float(logprobs[p, ids[0, p + 1]]) for p in positions)
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("kind", ["parallel", "beam"])
def test_forked_sequences_share_the_prompt_blocks(checkpoint_dirs, kind):
    """After the prompt step, 4 samples of one 32-token prompt hold its 4 blocks once (shared,
    reference-counted), where 4 separate requests hold 16."""
    prompt = random_prompt(4 * BLOCK_SIZE, seed=3)
    if kind == "parallel":
        shared = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)
    else:
        shared = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=4, ignore_eos=True)
    single = SamplingParams(temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)

    forked = make_engine(checkpoint_dirs)
    forked.add_request("n4", {"prompt_token_ids": prompt}, shared)
    forked.step()
    separate = make_engine(checkpoint_dirs)
    for i in range(4):
        separate.add_request(str(i), {"prompt_token_ids": prompt}, single)
    separate.step()
    assert len(forked.scheduler.running[0].get_unfinished_seqs()) == 4
    assert num_used_blocks(forked) == 4
    assert num_used_blocks(separate) == 16
    # The next step writes each sample's token into a block of its own (copy-on-write would
    # copy a shared partial block; here block 5 is fresh): the 4 prompt blocks stay shared.
    # Beam search then keeps only the surviving beams' blocks, and beams forked from the
    # same parent share that parent's new block too.
    forked.step()
    if kind == "parallel":
        assert num_used_blocks(forked) == 4 + 4
    else:
        assert 4 < num_used_blocks(forked) <= 4 + 4


def test_parallel_sampling_returns_n_distinct_completions(checkpoint_dirs):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    engine = make_engine(checkpoint_dirs)
    output = run(engine, {"r": (random_prompt(10, seed=1), params)})["r"]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_best_of_keeps_the_n_most_likely_samples(checkpoint_dirs):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=2, max_tokens=6, ignore_eos=True, logprobs=0)
    output = run(make_engine(checkpoint_dirs), {"r": (random_prompt(10, seed=2), params)})["r"]
    assert len(output.outputs) == 2
    scores = [c.cumulative_logprob for c in output.outputs]
    assert scores == sorted(scores, reverse=True)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(checkpoint_dirs):
    prompt = random_prompt(9, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = run(make_engine(checkpoint_dirs), {"s": (prompt, params)})["s"].outputs[0].token_ids
    # Same request, now batched with unseeded neighbours (and a different global seed).
    noisy = {f"other{i}": (random_prompt(5 + i, seed=i), SamplingParams(temperature=1.0, max_tokens=10))
             for i in range(3)}
    batched = run(make_engine(checkpoint_dirs, seed=99), {**noisy, "s": (prompt, params)})["s"].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=10, ignore_eos=True)
    assert run(make_engine(checkpoint_dirs), {"s": (prompt, other_seed)})["s"].outputs[0].token_ids != alone


def test_logprobs_and_prompt_logprobs_match_the_models_distribution(checkpoint_dirs):
    _, hf_model = checkpoint_dirs["qwen2"]
    prompt = random_prompt(7, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    output = run(make_engine(checkpoint_dirs, "qwen2"), {"r": (prompt, params)})["r"]
    completion = output.outputs[0]
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(ids).logits[0].float(), -1)
    # Prompt: position 0 has none; position t holds token t under the row of position t - 1.
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        entry = output.prompt_logprobs[t]
        row = reference[t - 1]
        assert entry[prompt[t]].logprob == pytest.approx(float(row[prompt[t]]), abs=1e-4)
        assert entry[prompt[t]].rank == int((row > row[prompt[t]]).sum()) + 1
        assert set(torch.topk(row, 2).indices.tolist()) <= set(entry)
    # Output: greedy, so each token is rank 1 and the top-3 are the model's top-3.
    assert len(completion.logprobs) == 4
    cumulative = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(float(row.max()), abs=1e-4)
        assert set(entry) == set(torch.topk(row, 3).indices.tolist())
        assert entry[token].decoded_token == checkpoints.build_tokenizer().decode([token])
        cumulative += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_seeded_samples_do_not_change_under_preemption(checkpoint_dirs, preemption_mode):
    """A seeded request's tokens depend only on its own generator, so a pool small enough to
    preempt it (swapping n=2 groups out and back, or recomputing n=1 ones) changes nothing."""
    n = 2 if preemption_mode == "swap" else 1
    requests = {str(i): (random_prompt(12 + i, seed=i), SamplingParams(n=n, temperature=1.0, seed=100 + i,
                                                                      max_tokens=20, ignore_eos=True))
                for i in range(6)}
    roomy = run(make_engine(checkpoint_dirs), requests)
    tight_engine = make_engine(checkpoint_dirs, num_gpu_blocks_override=12, preemption_mode=preemption_mode,
                               max_num_seqs=8)
    recorder = SnapshotRecorder(tight_engine)
    tight = run(tight_engine, requests)
    moved = [s for s in recorder.snapshots if s.preempted]
    assert moved, "the small pool should have forced a preemption"
    if preemption_mode == "swap":
        assert any(s.blocks_to_swap_out for s in recorder.snapshots)
    for request_id in requests:
        assert [c.token_ids for c in tight[request_id].outputs] == [c.token_ids for c in roomy[request_id].outputs]
    block_manager = tight_engine.scheduler.block_manager
    assert block_manager.get_num_free_gpu_blocks() == tight_engine.cache_config.num_gpu_blocks
    assert block_manager.get_num_free_cpu_blocks() == tight_engine.cache_config.num_cpu_blocks


def test_beam_search_with_penalties_keeps_one_statistics_row_per_live_beam(checkpoint_dirs):
    """Each step's beams are new sequences: the sampler's penalty statistics must drop the
    rows of the beams it did not keep, or a long beam search fills the device's memory."""
    engine = make_engine(checkpoint_dirs)
    sampler = engine.model_executor.driver_worker.model_runner.sampler.device_sampler
    params = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=40, ignore_eos=True,
                            repetition_penalty=1.3)
    engine.add_request("beams", {"prompt_token_ids": random_prompt(6, seed=3)}, params)
    most_rows = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_rows = max(most_rows, len(sampler.token_stats.slots))
    assert most_rows <= 4
