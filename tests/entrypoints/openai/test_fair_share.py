"""One huge request does not starve the rest: prompts x n is capped (400), a prompt far past
the context is refused from its beginning alone, and a large request's prompts reach the
engine a few at a time, so a small request that arrives later starts before it ends."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import IN_FLIGHT_SHARE

from .conftest import MODEL_NAME


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)


@pytest.mark.parametrize("fields,param", [({"prompt": ["x"] * 64, "n": 8}, "n"),
                                          ({"prompt": ["x"] * 32, "n": 1, "best_of": 16}, "best_of")])
def test_prompts_times_n_is_capped(server, fields, param):
    response = post(server, {**fields, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "at most 256 per request" in error["message"]
    assert post(server, {"prompt": ["x"] * 64, "n": 4, "max_tokens": 1}).status_code == 200  # 256: allowed


def test_the_cap_is_a_server_flag(engine):
    from minivllm.entrypoints.openai.api_server import app_options
    from minivllm.entrypoints.openai.cli_args import make_arg_parser

    args = make_arg_parser().parse_args(["--max-seqs-per-request", "12", "--max-seqs-in-flight-per-request", "3"])
    options = app_options(args, {})
    assert (options["max_seqs_per_request"], options["max_seqs_in_flight_per_request"]) == (12, 3)
    serving = OpenAIServingCompletion(engine, [MODEL_NAME], max_seqs_per_request=12, max_seqs_in_flight=3)
    assert (serving.max_seqs_per_request, serving.max_seqs_in_flight) == (12, 3)
    assert OpenAIServingCompletion(engine, [MODEL_NAME]).max_seqs_in_flight == 16 // IN_FLIGHT_SHARE


def test_a_huge_prompt_is_refused_before_it_is_tokenized_whole(server, engine, monkeypatch):
    serving = OpenAIServingCompletion(engine, [MODEL_NAME])
    lengths: list[int] = []
    real_encode = serving.encode

    async def recording_encode(text, add_special_tokens):
        lengths.append(len(text))
        return await real_encode(text, add_special_tokens)

    monkeypatch.setattr(serving, "encode", recording_encode)
    huge = "word " * 780_000  # 3.9 MB
    with pytest.raises(Exception, match="maximum context length") as error:
        asyncio.run(serving.encode_prompt(huge, add_special_tokens=True))
    assert error.value.code == "context_length_exceeded"
    assert lengths and max(lengths) <= serving.max_prompt_chars < len(huge) // 100
    # Over HTTP (as JSON: 3.9 MB, under the body limit) a 400, and a prompt that fits still works.
    response = httpx.post(server.url + "/v1/completions", content=json.dumps(
        {"model": MODEL_NAME, "prompt": huge, "max_tokens": 1}), headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert post(server, {"prompt": "word " * 50, "max_tokens": 1}).status_code == 200


def test_a_text_that_packs_many_characters_per_token_is_still_tokenized_whole(engine):
    """The beginning decides only when it overflows the context; otherwise the whole text does."""
    serving = OpenAIServingCompletion(engine, [MODEL_NAME])
    serving.max_prompt_chars = 40  # as if tokens were at most 40 characters long
    text = "ROMEO: " * 20  # 140 characters, far fewer tokens than the context holds
    assert asyncio.run(serving.encode_prompt(text, True)) == serving.tokenizer.encode(text)


def test_a_small_request_starts_before_a_large_one_ends(server, engine, assert_all_blocks_free):
    """32 prompts x n=4 (128 sequences, 8 full steps' worth on this server) then, once it runs,
    one small request: the small one's first token arrives while most of the large one is
    still to come (its prompts join the queue as its earlier ones finish)."""
    big_done = threading.Event()
    big = {}

    def run_big():
        big["response"] = post(server, {"prompt": [f"Scene {i}." for i in range(32)], "n": 4, "max_tokens": 8,
                                        "temperature": 1.0, "ignore_eos": True})
        big_done.set()

    thread = threading.Thread(target=run_big, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    in_engine = engine.engine.scheduler.get_num_unfinished_seq_groups()
    assert 1 <= in_engine * 4 <= engine.engine.scheduler_config.max_num_seqs // IN_FLIGHT_SHARE, in_engine
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 2, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    assert not big_done.is_set(), "the small request waited for the whole large one"
    thread.join(120)
    assert big["response"].status_code == 200 and len(big["response"].json()["choices"]) == 128
    assert_all_blocks_free()
