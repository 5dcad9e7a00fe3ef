"""A bounded load test: 64 concurrent streaming clients, a fifth of them hang up early.

Bounded in count (64 clients of 8 tokens) and time (60 s), on loopback only. Afterwards the engine holds no request, every KV block is back in the pool, the server is
healthy, and the Prometheus counters agree with what the clients received.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

NUM_CLIENTS = 64
DISCONNECT_EVERY = 5  # clients 0, 5, 10, ... leave after their first chunk
MAX_TOKENS = 8


def read_metrics(url: str) -> dict[str, float]:
    """`/metrics` parsed with prometheus-client's own parser: sample name -> value."""
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def one_client(client: openai.AsyncOpenAI, i: int) -> dict:
    stream = await client.completions.create(
        model="tiny-shakespeare", prompt=f"Scene {i}. Enter ROMEO.\n", max_tokens=MAX_TOKENS, temperature=1.0,
        seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].text
            if i % DISCONNECT_EVERY == 0:
                await stream.close()  # hang up mid-stream
                return {"left": True}
    return {"left": False, "text": text, "usage": usage}


async def run_clients(url: str) -> list[dict]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        return await asyncio.gather(*(one_client(client, i) for i in range(NUM_CLIENTS)))


def test_64_streams_with_early_disconnects(server, engine, assert_all_blocks_free):
    before = read_metrics(server.url)
    results = asyncio.run(asyncio.wait_for(run_clients(server.url), timeout=60))

    finished = [r for r in results if not r["left"]]
    assert sum(r["left"] for r in results) == len(range(0, NUM_CLIENTS, DISCONNECT_EVERY))
    assert all(r["usage"].completion_tokens == MAX_TOKENS for r in finished)

    assert_all_blocks_free()
    assert httpx.get(server.url + "/health").status_code == 200
    assert engine.is_running

    after = read_metrics(server.url)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    # Every finished request generated MAX_TOKENS; the aborted ones at least one each.
    assert delta["vllm:generation_tokens_total"] >= MAX_TOKENS * len(finished) + (NUM_CLIENTS - len(finished))
    assert delta["vllm:generation_tokens_total"] <= MAX_TOKENS * NUM_CLIENTS
    # A client that hangs up may still see its request finish if the abort lands late.
    assert len(finished) <= delta["vllm:e2e_request_latency_seconds_count"] <= NUM_CLIENTS
    assert delta["vllm:time_to_first_token_seconds_count"] == NUM_CLIENTS
    # Idle: no request anywhere, no KV block in use, and no `_created` timestamps among the series.
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:num_requests_swapped"] == 0 and after["vllm:gpu_cache_usage_perc"] == 0
    assert not [name for name in after if name.endswith("_created")]


def test_a_client_that_gives_up_on_a_non_streamed_request_frees_its_blocks(server, assert_all_blocks_free):
    before = read_metrics(server.url)
    long_request = {"model": "tiny-shakespeare", "prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=long_request, timeout=0.5)  # hang up after 0.5 s
    assert_all_blocks_free()
    after = read_metrics(server.url)
    # The request was aborted, not finished: no end-to-end latency recorded, < 200 tokens made.
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 200
