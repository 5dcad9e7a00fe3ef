"""The server with its engine in another process (`minivllm serve`'s default, as vLLM v0.6):
the same answers as the offline engine, streamed token by token, with the metrics, health and
errors of the in-process server.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.multiprocessing.client import MQLLMEngineClient
from minivllm.entrypoints.openai.api_server import ServerThread, build_app, build_engine_client
from minivllm.sampling_params import SamplingParams

from .conftest import ENGINE_KWARGS, MODEL_NAME


@pytest.fixture(scope="module")
def mq_server():
    engine = build_engine_client(EngineArgs(**ENGINE_KWARGS))  # the default: its own process
    assert isinstance(engine, MQLLMEngineClient)
    try:
        with ServerThread(build_app(engine, MODEL_NAME)) as running:
            yield running
    finally:
        engine.shutdown()


def test_streamed_and_plain_completions_equal_the_offline_engine(mq_server, llm):
    client = openai.OpenAI(base_url=mq_server.url + "/v1", api_key="unused", max_retries=0)
    prompts = ["ROMEO:", "JULIET:\nO"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10),
                                                         use_tqdm=False)]
    plain = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10, temperature=0.0)
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == expected
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=10, temperature=0.0,
                                            stream=True))
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(pieces) == expected[0] and len(pieces) > 1  # streamed piece by piece
    metrics = httpx.get(mq_server.url + "/metrics").text
    generated = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= 30  # 2 x 10 + 10 tokens, counted here


def test_streamed_choices_with_logprobs_add_up_to_the_plain_answer(mq_server):
    """Streams travel from the engine process as DELTA outputs: n choices, logprobs and a stop
    string add up to what a plain request returns."""
    client = openai.OpenAI(base_url=mq_server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL_NAME, prompt="ROMEO:", max_tokens=16, n=2, temperature=1.0, seed=5, logprobs=1,
                  stop=["e,"])
    plain = {c.index: c for c in client.completions.create(**kwargs).choices}
    text, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens
    assert text == {i: c.text for i, c in plain.items()}
    assert tokens == {i: c.logprobs.tokens for i, c in plain.items()}


def test_a_bad_request_is_a_400_and_the_server_goes_on(mq_server):
    client = openai.OpenAI(base_url=mq_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[], max_tokens=4)
    assert httpx.get(mq_server.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL_NAME, prompt="KING", max_tokens=3).usage.completion_tokens == 3
