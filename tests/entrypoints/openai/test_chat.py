"""`/v1/chat/completions` through the official `openai` client against a real server.

The reference prompt comes from transformers' own `apply_chat_template` on the bundled
tokenizer, and the reference completion from `LLM.generate` on those token ids.
"""

from __future__ import annotations

import httpx

from minivllm.sampling_params import SamplingParams

MESSAGES = [
    {"role": "system", "content": "You are a player in a Shakespeare comedy."},
    {"role": "user", "content": "Good morrow, sweet friend."},
]


def reference(llm, max_tokens, **params):
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes <s> itself
    output = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=max_tokens, **params), use_tqdm=False)
    return prompt_ids, output[0].outputs[0]


def test_greedy_chat_equals_llm_generate_on_the_chat_template(client, llm):
    prompt_ids, expected = reference(llm, 10, temperature=0.0)
    response = client.chat.completions.create(model="tiny-shakespeare", messages=MESSAGES, max_tokens=10, temperature=0.0)
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.object == "chat.completion"


def test_tokenize_messages_uses_the_chat_template(server, llm):
    prompt_ids, _ = reference(llm, 1, temperature=0.0)
    tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokens == prompt_ids


def test_chat_stream_role_first_then_content(client, llm):
    _, expected = reference(llm, 10, temperature=0.0)
    chunks = list(
        client.chat.completions.create(
            model="tiny-shakespeare", messages=MESSAGES, max_tokens=10, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(client, server):
    # No max_tokens, EOS ignored: generation runs until prompt + output = max_model_len (256).
    messages = [{"role": "user", "content": "To be, or not to be, that is the question. " * 17}]
    num_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]
    assert 200 < num_prompt < 256  # a long prompt keeps the test short
    response = client.chat.completions.create(model="tiny-shakespeare", messages=messages, temperature=0.0, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.total_tokens == 256


def test_chat_logprobs(client, llm):
    _, expected = reference(llm, 5, temperature=0.0, logprobs=2)
    response = client.chat.completions.create(
        model="tiny-shakespeare", messages=MESSAGES, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry, token_id, step in zip(content, expected.token_ids, expected.logprobs):
        assert abs(entry.logprob - step[token_id].logprob) < 1e-5
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6  # greedy
        assert bytes(entry.bytes).decode() == entry.token


def test_chat_n_and_stop(client):
    response = client.chat.completions.create(
        model="tiny-shakespeare", messages=MESSAGES, max_tokens=16, n=2, temperature=1.0, seed=3, stop=["\n"]
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert "\n" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")
