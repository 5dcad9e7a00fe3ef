"""Malformed and hostile requests: always a 4xx with OpenAI's error body, never a 500.

Raw bytes over httpx, so that nothing on the client side cleans the request up first. As in
vLLM, every bad request is a 400 naming the field (an unknown model or route: 404). After the
whole barrage the server is healthy, serves normally and holds no KV block.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    """A JSON body for the served model (unless the test gives its own `model`)."""
    return json.dumps({"model": "tiny-shakespeare", **fields}).encode()


BAD_REQUESTS = [
    # (route, raw body, expected status, expected `param` or None)
    (COMPLETIONS, body(prompt="x", max_tokens=10**9), 400, "max_tokens"),  # exceeds the context
    (COMPLETIONS, body(prompt="word " * 400, max_tokens=4), 400, None),  # prompt too long
    (COMPLETIONS, body(prompt="x", max_tokens=-1), 400, None),
    (COMPLETIONS, body(prompt="x", max_tokens=0), 400, None),
    (COMPLETIONS, body(prompt="x", temperature=-0.5), 400, None),
    (COMPLETIONS, body(prompt="x", top_p=0.0), 400, None),
    (COMPLETIONS, body(prompt="x", top_k=0), 400, None),
    (COMPLETIONS, body(prompt="x", n=0), 400, None),
    (COMPLETIONS, body(prompt="x", n=10**6), 400, "n"),
    (COMPLETIONS, body(prompt="x", n=2, best_of=1), 400, None),
    (COMPLETIONS, body(prompt="x", presence_penalty=5.0), 400, None),
    (COMPLETIONS, body(prompt="x", logprobs=-1), 400, None),
    (COMPLETIONS, body(prompt="x", logprobs=1000), 400, "logprobs"),
    (COMPLETIONS, body(prompt="x", seed=2**80), 400, None),
    (COMPLETIONS, body(prompt="x", min_tokens=5, max_tokens=2), 400, None),
    (COMPLETIONS, body(prompt="x", stop_token_ids=[-3]), 400, None),
    (COMPLETIONS, body(prompt="x", use_beam_search=True, n=2, stream=True), 400, None),
    (COMPLETIONS, body(prompt="x", stream_options={"include_usage": True}), 400, None),
    (COMPLETIONS, body(prompt="x", priority=5), 400, None),  # the server runs the fcfs policy
    (COMPLETIONS, body(prompt="x", n=2, use_beam_search=True, temperature=0, length_penalty=1e30), 400, "length_penalty"),
    (COMPLETIONS, b'{"model": "tiny-shakespeare", "prompt": "x", "temperature": NaN}', 400, "temperature"),  # Python's JSON reads NaN
    (COMPLETIONS, b'{"model": "tiny-shakespeare", "prompt": "x", "top_p": Infinity}', 400, "top_p"),
    (COMPLETIONS, b'{"model": "tiny-shakespeare", "prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (COMPLETIONS, body(prompt=""), 400, "prompt"),
    (COMPLETIONS, body(prompt=[]), 400, "prompt"),
    (COMPLETIONS, body(prompt=[10**9]), 400, "prompt"),  # not a token of the vocabulary
    (COMPLETIONS, body(prompt=[-1]), 400, "prompt"),
    (COMPLETIONS, body(prompt="x", model="gpt-17"), 404, "model"),
    (COMPLETIONS, json.dumps({"prompt": "x"}).encode(), 400, "model"),  # no model: required, as in OpenAI
    (COMPLETIONS, body(prompt="x", model=None), 400, "model"),
    (COMPLETIONS, body(prompt="x", max_tokens="many"), 400, "max_tokens"),
    (COMPLETIONS, body(prompt="x", temperature="hot"), 400, "temperature"),
    (COMPLETIONS, body(prompt="x", stream="yes"), 400, "stream"),
    (COMPLETIONS, body(prompt="x", skip_special_tokens=1), 400, "skip_special_tokens"),
    (COMPLETIONS, body(prompt={"text": "x"}), 400, "prompt"),
    (COMPLETIONS, body(max_tokens=4), 400, "prompt"),  # no prompt at all
    (COMPLETIONS, body(prompt="\udc80"), 400, "prompt"),  # a lone surrogate: not UTF-8 text
    (COMPLETIONS, b'{"model": "tiny-shakespeare", "prompt": "\xff\xfe\xfd"}', 400, None),  # raw bytes, not UTF-8
    (COMPLETIONS, b'{"prompt": "x", ', 400, None),  # malformed JSON
    (COMPLETIONS, b"[1, 2, 3]", 400, None),
    (COMPLETIONS, b"", 400, None),
    (CHAT, body(messages=[]), 400, "messages"),
    (CHAT, body(messages="hi"), 400, "messages"),
    (CHAT, body(messages=[{"role": "user"}]), 400, "messages"),
    (CHAT, body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    (CHAT, json.dumps({"messages": HELLO}).encode(), 400, "model"),
    (CHAT, body(messages=HELLO, max_tokens=10**9), 400, "max_tokens"),
    (CHAT, body(messages=HELLO, top_logprobs=2), 400, None),  # needs logprobs=true
    (CHAT, body(messages=HELLO, logit_bias={"5": 100}), 400, None),
    (CHAT, body(messages=HELLO, model="nope"), 404, "model"),
    # Limits that keep one request from slowing every other stream.
    (COMPLETIONS, body(prompt="x", stop=[f"s{i}" for i in range(1000)]), 400, "stop"),
    (COMPLETIONS, body(prompt="x", stop_token_ids=list(range(1000))), 400, "stop_token_ids"),
    (CHAT, body(messages=HELLO * 2000), 400, "messages"),
]


@pytest.mark.parametrize("route,raw,status,param", BAD_REQUESTS, ids=lambda v: str(v)[:40] if isinstance(v, bytes) else None)
def test_bad_request_gets_an_openai_error(server, route, raw, status, param):
    response = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_unknown_route_and_method(server):
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + COMPLETIONS).status_code == 405


def test_client_sees_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny-shakespeare", prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-shakespeare", messages=[])


def test_server_survives_the_barrage(server, client, assert_all_blocks_free):
    assert httpx.get(server.url + "/health").status_code == 200
    response = client.completions.create(model="tiny-shakespeare", prompt="ROMEO:", max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert_all_blocks_free()


def test_a_failing_engine_step_is_reported_and_the_server_goes_on(engine, client, monkeypatch, assert_all_blocks_free):
    """Fault injection into the real engine: its third step raises (then every third one)."""
    real_step = engine.engine.step
    calls = {"n": 0}

    def step_failing_every_third_call():
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", step_failing_every_third_call)
    kwargs = dict(model="tiny-shakespeare", prompt="ROMEO:", max_tokens=50, extra_body={"ignore_eos": True})
    # Streaming: the headers are sent, so the error arrives in-band as an SSE error event. It
    # names a request id to look up in the log, never the exception's text.
    with pytest.raises(openai.APIError, match="request id") as streamed:
        for _ in client.completions.create(stream=True, **kwargs):
            pass
    # Not streaming: a 500 with OpenAI's error body (the server's fault, not the request's).
    with pytest.raises(openai.InternalServerError, match="request id") as whole:
        client.completions.create(**kwargs)
    for error in (streamed.value, whole.value):
        assert "injected" not in str(error) and "RuntimeError" not in str(error)
    monkeypatch.undo()
    assert client.completions.create(**kwargs).choices[0].finish_reason == "length"
    assert_all_blocks_free()
