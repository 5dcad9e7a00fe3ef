"""`/v1/completions` through the official `openai` client against a real server.

The reference is the offline engine (`LLM.generate`) on the same model: the server must add
nothing and lose nothing on the way.
"""

from __future__ import annotations

import math

import pytest

from minivllm.sampling_params import SamplingParams

PROMPT = "ROMEO:"
MAX_TOKENS = 12


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs


def test_greedy_completion_equals_llm_generate(client, llm):
    expected = offline(llm, PROMPT, temperature=0.0, max_tokens=MAX_TOKENS)[0]
    response = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPT))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.model == "tiny-shakespeare" and response.object == "text_completion"


def test_token_id_prompt_and_batch_of_prompts(client, llm):
    prompts = ["ROMEO:", "JULIET:\nO"]
    expected = [offline(llm, p, temperature=0.0, max_tokens=6)[0].text for p in prompts]
    token_ids = llm.get_tokenizer().encode(prompts[1])
    by_ids = client.completions.create(model="tiny-shakespeare", prompt=token_ids, max_tokens=6, temperature=0.0)
    assert by_ids.choices[0].text == expected[1]
    batch = client.completions.create(model="tiny-shakespeare", prompt=prompts, max_tokens=6, temperature=0.0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == expected


def test_streaming_deltas_add_up_to_the_completion(client, llm):
    expected = offline(llm, PROMPT, temperature=0.0, max_tokens=MAX_TOKENS)[0]
    stream = client.completions.create(
        model="tiny-shakespeare", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len(text_chunks) > 1  # really streamed, not one blob
    # OpenAI's include_usage: one last chunk with no choices and the usage.
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in text_chunks)


def test_stream_without_usage_sends_no_usage_chunk(client):
    chunks = list(client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=4, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_n_choices_with_seed_stream_like_they_complete(client):
    kwargs = dict(model="tiny-shakespeare", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * 8
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {c.index: c.text for c in whole.choices}


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        response = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed)
        return response.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_string_truncates_like_vllm(client, llm):
    full = offline(llm, PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    response = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop])
    (choice,) = response.choices
    assert choice.text == full[: full.index(stop)]  # the stop string itself is not returned
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop  # vLLM's extra field


def test_a_streamed_stop_string_never_shows_its_first_characters(client, llm):
    """The engine holds back the characters a stop string could still be completing in, so no
    chunk sends text that the stop string later cuts (as vLLM)."""
    full = offline(llm, PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    chunks = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                       stop=[stop], stream=True)
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == full[: full.index(stop)]
    assert len([p for p in pieces if p]) > 1


def test_streamed_text_offsets_equal_the_plain_answer_with_a_stop_string(client):
    """Legacy logprobs' `text_offset` counts the tokens' text, not the text sent so far, which
    holds back the characters a stop string could still cut (a review found the lag)."""
    kwargs = dict(model="tiny-shakespeare", prompt=PROMPT, max_tokens=16, temperature=0.0, logprobs=1,
                  stop=["@@@@"], extra_body={"ignore_eos": True})  # never generated: 3 characters held back
    plain = client.completions.create(**kwargs).choices[0]
    assert "@@@@" not in plain.text
    offsets, tokens = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            offsets += choice.logprobs.text_offset
            tokens += choice.logprobs.tokens
    assert tokens == plain.logprobs.tokens
    assert offsets == plain.logprobs.text_offset


def test_logprobs_match_the_engine(client, llm):
    expected = offline(llm, PROMPT, temperature=0.0, max_tokens=6, logprobs=3)[0]
    response = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert len(logprobs.token_logprobs) == len(expected.token_ids) == 6
    for token_id, step, logprob, top in zip(expected.token_ids, expected.logprobs, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob == pytest.approx(step[token_id].logprob, abs=1e-5)
        assert 3 <= len(top) <= 4  # the top 3, plus the chosen token when it is not among them
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy picks the most likely
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_echo_prepends_the_prompt(client):
    response = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True)
    plain = client.completions.create(model="tiny-shakespeare", prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert response.choices[0].text == PROMPT + plain.choices[0].text


def test_models_tokenize_detokenize(client, server, llm):
    import httpx

    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-shakespeare"]
    tokenizer = llm.get_tokenizer()
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "To be, or not to be"}).json()
    assert tokens["tokens"] == tokenizer.encode("To be, or not to be") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(tokens["tokens"])
    assert httpx.get(server.url + "/health").status_code == 200


def test_beam_search_equals_llm_generate(client, llm):
    params = dict(n=2, use_beam_search=True, temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.text for o in offline(llm, PROMPT, **params)]
    response = client.completions.create(
        model="tiny-shakespeare", prompt=PROMPT, n=2, max_tokens=6, temperature=0.0,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert [c.text for c in response.choices] == expected


def test_vllm_extras_reach_the_engine(client, llm):
    """stop_token_ids and top_k / min_p / repetition_penalty are passed through unchanged."""
    greedy = offline(llm, PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True)[0]
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    response = client.completions.create(
        model="tiny-shakespeare", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [stop_id]}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop_id
    assert response.usage.completion_tokens == first + 1  # the stop token is generated, not shown
    extras = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, seed=11)
    expected = offline(llm, PROMPT, temperature=0.8, max_tokens=10, **extras)[0].text
    response = client.completions.create(
        model="tiny-shakespeare", prompt=PROMPT, max_tokens=10, temperature=0.8, seed=11,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3},
    )
    assert response.choices[0].text == expected
