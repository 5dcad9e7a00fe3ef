"""No request, however malformed, changes what any other request receives (issue 13).

Good streams run while every hostile request of the issue is fired at the same server; each
hostile one gets its 4xx (or, for one that fails inside a step, a finish_reason of its own),
and every good stream ends with exactly the text it gets when it runs alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "tiny-shakespeare"
VOCAB = 4096  # the bundled model's vocabulary
GOOD_PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "Enter HAMLET."]
GOOD = dict(max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
BEAM = dict(n=2, best_of=2, use_beam_search=True, temperature=0)

# (name, body, expected status): the kinds of value of the issue that crashed a step (the
# server has no `prompt_logprobs` field: unknown fields are ignored, as in OpenAI's API), then
# the server's own.
HOSTILE = [
    ("logprobs over the vocabulary", dict(prompt="x", logprobs=VOCAB + 1), 400),
    ("stop token outside the vocabulary", dict(prompt="x", stop_token_ids=[VOCAB], min_tokens=1), 400),
    ("seed of 2**64", dict(prompt="x", seed=2**64), 400),
    ("seed true", dict(prompt="x", seed=True), 400),
    ("top_k of 2**63", dict(prompt="x", top_k=2**63), 400),
    ("length_penalty 400", dict(prompt="x", length_penalty=400, **BEAM), 400),
    ("length_penalty 1e300", dict(prompt="x", length_penalty=1e300, **BEAM), 400),
    ("length_penalty -1e300", dict(prompt="x", length_penalty=-1e300, **BEAM), 400),
    ("skip_special_tokens not a bool", dict(prompt="x", skip_special_tokens="no"), 400),
    ("min_tokens past the context", dict(prompt="x", min_tokens=10_000, max_tokens=None), 400),
    ("temperature NaN", b'{"model": "tiny-shakespeare", "prompt": "x", "temperature": NaN}', 400),
    ("no model", dict(prompt="x", model=None), 400),
    ("unknown model", dict(prompt="x", model="gpt-17"), 404),
    ("too many prompts", dict(prompt=["x"] * 65, max_tokens=1), 400),
    ("a body over the limit", dict(prompt="x" * (5 * 2**20)), 413),
    ("a prompt of token ids over the vocabulary", dict(prompt=[VOCAB, 2**63]), 400),
]


async def good_stream(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **GOOD)
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def hostile_request(http: httpx.AsyncClient, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json={"model": MODEL, **body}).content
    return await http.post("/v1/completions", content=content, headers={"content-type": "application/json"})


async def storm(url: str) -> tuple[list[str], list[httpx.Response]]:
    """Start the good streams, fire every hostile request while they run, collect both."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client, \
            httpx.AsyncClient(base_url=url, timeout=60) as http:
        streams = [asyncio.ensure_future(good_stream(client, p)) for p in GOOD_PROMPTS]
        await asyncio.sleep(0.05)  # the streams are under way
        rebinding = http.get("/v1/models", headers={"Host": "evil.example"})  # a DNS-rebinding page
        *responses, rebound = await asyncio.gather(*(hostile_request(http, body) for _, body, _ in HOSTILE), rebinding)
        assert rebound.status_code == 400
        return await asyncio.gather(*streams), responses


@pytest.fixture(scope="module")
def texts_alone(client) -> list[str]:
    return ["".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=p, stream=True, **GOOD)
                    if c.choices) for p in GOOD_PROMPTS]


def test_hostile_requests_leave_the_other_streams_untouched(server, engine, texts_alone, assert_all_blocks_free):
    checkpoint_folder = str(Path(engine.model_config.model).parent)
    texts, responses = asyncio.run(asyncio.wait_for(storm(server.url), timeout=60))
    for (name, _, status), response in zip(HOSTILE, responses):
        assert response.status_code == status, (name, response.text[:300])
        assert response.json()["error"]["message"], name
        assert checkpoint_folder not in response.text and "Traceback" not in response.text, name
    assert texts == texts_alone
    assert_all_blocks_free()


def test_a_request_failing_inside_a_step_ends_alone_and_the_streams_go_on(server, engine, monkeypatch, texts_alone,
                                                                           assert_all_blocks_free):
    """Fault injection: the model raises whenever the poisoned prompt is in the batch."""
    llm_engine = engine.engine
    poison = llm_engine.get_tokenizer().encode("POISON")
    real = llm_engine.model_executor.execute_model

    def execute_model(request):
        if any(poison == next(iter(m.seq_data.values())).prompt_token_ids for m in request.seq_group_metadata_list):
            raise IndexError("injected")
        return real(request)

    monkeypatch.setattr(llm_engine.model_executor, "execute_model", execute_model)

    async def run() -> tuple[list[str], openai.types.Completion]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            streams = [asyncio.ensure_future(good_stream(client, p)) for p in GOOD_PROMPTS]
            await asyncio.sleep(0.05)
            poisoned = await client.completions.create(model=MODEL, prompt="POISON", max_tokens=4)
            return await asyncio.gather(*streams), poisoned

    texts, poisoned = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert texts == texts_alone
    (choice,) = poisoned.choices
    assert choice.finish_reason == "abort" and "engine step" in choice.stop_reason
    assert "injected" not in choice.stop_reason and "IndexError" not in choice.stop_reason
    monkeypatch.undo()
    assert_all_blocks_free()
