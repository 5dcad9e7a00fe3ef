"""The sampler against references nobody here wrote: transformers' logits processors,
OpenAI's penalty definitions worked by hand, and brute-force beam candidates."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minivllm.kernels import reference as spec
from minivllm.model_executor.layers import sampler as sampler_module
from minivllm.model_executor.layers.sampler import Sampler
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceData, SequenceGroupMetadata

VOCAB = 32


def decode_metadata(request_id, params, token_lists, prompt_len=3, first_seq_id=0):
    """A decode step for one request whose sequences hold `token_lists` (prompt + output)."""
    seq_data = {}
    for i, tokens in enumerate(token_lists):
        data = SequenceData(list(tokens[:prompt_len]), list(tokens[prompt_len:]))
        data.num_computed_tokens = len(tokens) - 1
        seq_data[first_seq_id + i] = data
    block_tables = {seq_id: [0] for seq_id in seq_data}
    return SequenceGroupMetadata(request_id, False, seq_data, params, block_tables, 1)


def prompt_metadata(request_id, params, prompt, seq_id=0):
    seq_data = {seq_id: SequenceData(list(prompt))}
    return SequenceGroupMetadata(request_id, True, seq_data, params, {seq_id: [0]}, len(prompt))


def run_sampler(metadata_list, logits_per_token, backend="torch"):
    """Run the sampler where every token of the flat batch has the row `logits_per_token[i]`
    (backend "triton": the device sampler's kernels, on the GPU if there is one, else in
    Triton's interpreter)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    query_lens = [m.token_chunk_size for m in metadata_list]
    sampling = SamplingMetadata.prepare(metadata_list, query_lens, device)
    hidden_logits = logits_per_token.to(device)[sampling.selected_token_indices]
    return Sampler(backend)(hidden_logits, sampling)


def full_logprobs(output):
    """The whole distribution from a sample asked with logprobs=VOCAB."""
    return torch.tensor([output.logprobs[t] for t in range(VOCAB)])


@pytest.fixture
def logits():
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_picks_argmax_and_reports_rank_one(logits):
    params = SamplingParams(temperature=0.0, logprobs=2)
    [out] = run_sampler([decode_metadata("r", params, [[1, 2, 3, 4]])], logits)
    [sample] = out.samples
    assert sample.output_token == int(logits[0].argmax())
    assert sample.rank == 1
    reference = torch.log_softmax(logits[0], -1)
    top2 = torch.topk(reference, 2).indices.tolist()
    assert set(sample.logprobs) == set(top2)
    assert sample.logprobs[sample.output_token] == pytest.approx(float(reference.max()), abs=1e-5)


def test_temperature_top_k_top_p_min_p_match_transformers_warpers(logits):
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, logprobs=VOCAB, seed=1)
    [out] = run_sampler([decode_metadata("r", params, [[1, 2, 3, 4]])], logits)
    scores = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        scores = warper(torch.tensor([[1, 2, 3, 4]]), scores)
    expected = torch.log_softmax(scores[0], -1)
    got = full_logprobs(out.samples[0])
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(got[finite], expected[finite], atol=1e-5, rtol=1e-5)
    assert out.samples[0].output_token in finite.nonzero().flatten().tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_over_prompt_and_output(logits, penalty, backend):
    tokens = [1, 5, 5, 7, 9]  # prompt [1, 5, 5], output [7, 9]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty, logprobs=VOCAB)
    [out] = run_sampler([decode_metadata("r", params, [tokens])], logits, backend=backend)
    scores = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), logits.clone())
    torch.testing.assert_close(full_logprobs(out.samples[0]), torch.log_softmax(scores[0], -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_frequency_and_presence_penalties_count_output_tokens_only(logits, backend):
    tokens = [4, 4, 6, 7, 7, 7, 8]  # prompt [4, 4, 6]; output 7 three times and 8 once
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.5, logprobs=VOCAB)
    [out] = run_sampler([decode_metadata("r", params, [tokens])], logits, backend=backend)
    expected = logits[0].clone()
    # OpenAI: mu[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty.
    expected[7] -= 3 * 0.5 + 1.5
    expected[8] -= 1 * 0.5 + 1.5
    torch.testing.assert_close(full_logprobs(out.samples[0]), torch.log_softmax(expected, -1), atol=1e-5, rtol=1e-5)


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 10.0  # token 3 (our "EOS") is by far the most likely
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], logprobs=VOCAB)
    params.all_stop_token_ids.add(3)  # the engine adds the model's EOS like this
    early = run_sampler([decode_metadata("r", params, [[1, 2, 9, 10]])], logits)[0].samples[0]
    assert early.output_token not in (3, 5)
    assert math.isinf(early.logprobs[3]) and math.isinf(early.logprobs[5])
    late = run_sampler([decode_metadata("r", params, [[1, 2, 9, 10, 11]])], logits)[0].samples[0]
    assert late.output_token == 3


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.zeros(2, VOCAB)  # uniform: every draw is pure randomness
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(with_neighbour: bool) -> list[int]:
        tokens = []
        for step in range(8):  # each draw one position further on, as in a real decode
            batch = [decode_metadata("seeded", seeded, [[1, 2, 3, 4] + [5] * step])]
            if with_neighbour:
                batch.insert(0, decode_metadata("other", SamplingParams(temperature=1.0), [[1, 2, 3, 4]], first_seq_id=9))
            outs = run_sampler(batch, logits)
            tokens.append(outs[-1].samples[0].output_token)
        return tokens

    alone = draw(False)
    assert alone == draw(False)
    assert alone == draw(True)
    assert len(set(alone)) > 1


def test_random_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1).contiguous()
    params = SamplingParams(temperature=1.0, seed=7)
    token_lists = [[1, 2, 3, 0]] * 4000
    metadata = decode_metadata("r", params, token_lists)
    sampling = SamplingMetadata.prepare([metadata], [1], "cpu")
    [out] = Sampler()(logits[sampling.selected_token_indices], sampling)
    counts = torch.bincount(torch.tensor([s.output_token for s in out.samples]), minlength=4).float()
    # Binomial standard deviation at n=4000 is below 0.008; allow 4 of them.
    torch.testing.assert_close(counts / 4000, probs, atol=0.032, rtol=0)


def test_prompt_fans_out_into_best_of_samples_of_the_same_parent():
    logits = torch.zeros(4, VOCAB)
    params = SamplingParams(n=2, best_of=3, temperature=1.0, seed=0)
    [out] = run_sampler([prompt_metadata("r", params, [1, 2, 3, 4], seq_id=42)], logits)
    assert len(out.samples) == 3
    assert {s.parent_seq_id for s in out.samples} == {42}


def test_prompt_logprobs_are_the_models_raw_distribution():
    prompt = [3, 1, 4, 1, 5]
    logits = torch.randn(len(prompt), VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.5, repetition_penalty=1.5, prompt_logprobs=2, max_tokens=1)
    [out] = run_sampler([prompt_metadata("r", params, prompt)], logits)
    reference = torch.log_softmax(logits, -1)
    # Row t predicts prompt token t + 1; the last row is for sampling only.
    assert len(out.prompt_logprobs) == len(prompt) - 1
    for t, (entry, rank) in enumerate(zip(out.prompt_logprobs, out.prompt_ranks)):
        target = prompt[t + 1]
        assert entry[target] == pytest.approx(float(reference[t, target]), abs=1e-5)
        assert rank == int((reference[t] > reference[t, target]).sum()) + 1
        assert set(torch.topk(reference[t], 2).indices.tolist()) <= set(entry)


def test_beam_search_proposes_the_best_2k_continuations_over_all_beams():
    beam_width = 2
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=4)
    metadata = decode_metadata("r", params, [[1, 2, 3, 7], [1, 2, 3, 8]], first_seq_id=10)
    metadata.seq_data[10].cumulative_logprob = -1.0
    metadata.seq_data[11].cumulative_logprob = -3.0
    sampling = SamplingMetadata.prepare([metadata], [1], "cpu")
    [out] = Sampler()(logits, sampling)
    # Brute force: every (beam, token) pair scored by cumulative + token logprob.
    logprobs = torch.log_softmax(logits, -1)
    scored = sorted(
        ((-1.0 + float(logprobs[0, t]), 10, t) for t in range(VOCAB)),
        reverse=True,
    ) + sorted(((-3.0 + float(logprobs[1, t]), 11, t) for t in range(VOCAB)), reverse=True)
    best = sorted(scored, reverse=True)[: 2 * beam_width]
    assert [(s.parent_seq_id, s.output_token) for s in out.samples] == [(p, t) for _, p, t in best]
    for sample, (_, parent, token) in zip(out.samples, best):
        row = 0 if parent == 10 else 1
        assert sample.logprobs[token] == pytest.approx(float(logprobs[row, token]), abs=1e-5)


def test_a_mixed_batch_keeps_each_request_on_its_own_rows():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(9))
    greedy = SamplingParams(temperature=0.0)
    batch = [
        prompt_metadata("p", greedy, [1, 2, 3, 4], seq_id=0),  # tokens 0..3, samples row 3
        decode_metadata("d1", greedy, [[1, 2, 3, 4]], first_seq_id=1),  # token 4
        decode_metadata("d2", greedy, [[1, 2, 3, 5]], first_seq_id=2),  # token 5
    ]
    outs = run_sampler(batch, logits)
    assert [o.samples[0].output_token for o in outs] == logits[[3, 4, 5]].argmax(-1).tolist()
    assert [o.samples[0].parent_seq_id for o in outs] == [0, 1, 2]


def test_plain_greedy_batch_gives_the_general_paths_tokens_and_logprobs():
    """A batch of plain greedy rows takes a fast path; asking for logprobs=0 forces the
    general one: same tokens, and both logprobs equal log_softmax of the logits."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11)) * 4
    def batch(params):
        return [decode_metadata(str(i), params, [[1, 2, 3, 4 + i]], first_seq_id=i) for i in range(3)]
    fast = run_sampler(batch(SamplingParams(temperature=0.0)), logits)
    general = run_sampler(batch(SamplingParams(temperature=0.0, logprobs=0)), logits)
    reference = torch.log_softmax(logits, -1)
    for i, (a, b) in enumerate(zip(fast, general)):
        [sa], [sb] = a.samples, b.samples
        assert sa.output_token == sb.output_token == int(logits[i].argmax())
        assert sa.logprobs[sa.output_token] == pytest.approx(float(reference[i].max()), abs=1e-5)
        assert sb.logprobs[sb.output_token] == pytest.approx(float(reference[i].max()), abs=1e-5)


def test_a_zero_noise_draw_never_samples_a_token_of_probability_zero(monkeypatch):
    """Bug found with vLLM 0.6's own sampler tests: the exponential race's E ~ Exp(1) may be
    drawn as exactly 0, its noise -log(E) is then +inf, and -inf + inf is NaN, which wins the
    arg-max, so a token masked to -inf was drawn. A generator rarely draws 0, so the test
    forces it for the impossible token (the PyTorch spec's noise, `reference.row_race_noise`)."""
    real_noise = spec.row_race_noise

    def zero_for_token_0(*args):
        noise = real_noise(*args)
        noise[0] = float("inf")
        return noise

    monkeypatch.setattr(spec, "row_race_noise", zero_for_token_0)
    metadata_list = [decode_metadata(str(i), SamplingParams(temperature=1.0), [[1, 2, 3, 4]]) for i in range(8)]
    for dtype in (torch.float16, torch.float32):
        logits = torch.zeros(8, VOCAB, dtype=dtype)
        logits[:, 0] = -float("inf")
        logits[:, 2:] = -float("inf")  # two tokens: one impossible, one certain
        outputs = run_sampler(metadata_list, logits)
        assert {o.samples[0].output_token for o in outputs} == {1}, dtype


def test_parallel_sampling_steps_are_sampled_on_the_device_row_by_row(monkeypatch):
    """After its fan-out, an unseeded n > 1 request's sequences are rows of the device path,
    each with its own penalties; a seeded one takes the parallel-sampling path (a seed per sibling)."""
    host_calls = []
    original = sampler_module.sample_parallel
    monkeypatch.setattr(sampler_module, "sample_parallel", lambda *args: host_calls.append(1) or original(*args))
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # token 7 is far ahead...
    logits[:, 9] = 4.0
    # ...but sequence 0 has produced it three times already, and a frequency penalty of 1
    # costs it 3: sequence 0 picks 9, sequence 1 (no 7 yet) keeps 7.
    params = SamplingParams(n=2, temperature=1e-3, frequency_penalty=1.0, max_tokens=9)
    outs = run_sampler([decode_metadata("r", params, [[1, 2, 3, 7, 7, 7], [1, 2, 3, 4, 4, 4]])], logits)
    assert [(s.parent_seq_id, s.output_token) for s in outs[0].samples] == [(0, 9), (1, 7)]
    assert not host_calls
    seeded = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9)
    run_sampler([decode_metadata("s", seeded, [[1, 2, 3, 7], [1, 2, 3, 4]])], logits)
    assert host_calls
