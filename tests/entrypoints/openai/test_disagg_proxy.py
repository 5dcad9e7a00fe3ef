"""`minivllm proxy` has the server's protections: the Host check, the body limit, the API key
passed on (to both servers and on /v1/models), 400 for a bad body, 502 for a server it cannot
reach, and streams with `stream_options`.

Stub servers record what reaches them; the stream test runs on this directory's real server
(as both the prefill and the decode server: without a KV store the decode server recomputes
the prompt, and the answer is the same).
"""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from minivllm.entrypoints.disagg_proxy import build_proxy_app
from minivllm.entrypoints.openai.api_server import ServerThread
from minivllm.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES

from .conftest import MODEL_NAME

KEY = {"Authorization": "Bearer sekret"}
BODY = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0.0}


def stub_server(name: str, seen: list, status_code: int = 200, break_stream: bool = False) -> FastAPI:
    """Answers every completion with its own name and records (name, path, key, body);
    `break_stream`: a stream breaks off after its first event."""
    app = FastAPI()

    async def complete(request: Request):
        body = await request.json()
        seen.append((name, request.url.path, request.headers.get("authorization"), body))
        if status_code != 200:
            return JSONResponse({"error": {"message": "down"}}, status_code)
        if body.get("stream"):
            async def events():
                yield 'data: {"choices": [{"text": "%s"}]}\n\n' % name
                if break_stream:
                    raise ConnectionError("the server went away mid-stream")
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": name}]}

    app.post("/v1/completions")(complete)
    app.post("/v1/chat/completions")(complete)

    @app.get("/v1/models")
    async def models(request: Request):
        seen.append((name, "/v1/models", request.headers.get("authorization"), None))
        return {"data": [{"id": name}]}

    return app


@pytest.fixture(scope="module")
def stubs():
    seen: list = []
    with ServerThread(stub_server("prefill", seen)) as prefill, ServerThread(stub_server("decode", seen)) as decode, \
            ServerThread(build_proxy_app(prefill.url, decode.url)) as proxy:
        yield proxy, seen


def test_the_key_reaches_both_servers_and_v1_models(stubs):
    proxy, seen = stubs
    seen.clear()
    answer = httpx.post(proxy.url + "/v1/completions", json=BODY, headers=KEY)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decode"
    assert httpx.get(proxy.url + "/v1/models", headers=KEY).json()["data"] == [{"id": "decode"}]
    assert [(name, path, key) for name, path, key, _ in seen] == [
        ("prefill", "/v1/completions", KEY["Authorization"]), ("decode", "/v1/completions", KEY["Authorization"]),
        ("decode", "/v1/models", KEY["Authorization"])]


def test_a_foreign_host_header_is_refused(stubs):
    proxy, seen = stubs
    seen.clear()
    for host in ("evil.example", f"evil.example:{proxy.port}"):  # what a DNS-rebinding page sends
        answer = httpx.post(proxy.url + "/v1/completions", json=BODY, headers={"Host": host})
        assert answer.status_code == 400, host
        assert httpx.get(proxy.url + "/v1/models", headers={"Host": host}).status_code == 400
    assert seen == []  # neither server was reached
    assert httpx.get(proxy.url + "/v1/models", headers={"Host": f"localhost:{proxy.port}"}).status_code == 200


def test_a_body_over_the_limit_is_a_413_whether_declared_or_chunked(stubs):
    proxy, seen = stubs
    seen.clear()
    big = json.dumps({**BODY, "prompt": "x" * DEFAULT_MAX_BODY_BYTES}).encode()
    declared = httpx.post(proxy.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and "larger than" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while reading
        for start in range(0, len(big), 2**16):
            yield big[start:start + 2**16]

    chunked = httpx.post(proxy.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
    assert seen == []


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b""])
def test_a_body_that_is_not_a_json_object_is_a_400(stubs, content):
    proxy, seen = stubs
    seen.clear()
    answer = httpx.post(proxy.url + "/v1/chat/completions", content=content,
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert seen == []


def test_a_server_that_cannot_be_reached_is_a_502_and_its_own_503_passes_through():
    seen: list = []
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    with ServerThread(stub_server("up", seen)) as up, ServerThread(stub_server("down", seen, 503)) as down:
        for prefill, decode in ((closed, up.url), (up.url, closed)):
            with ServerThread(build_proxy_app(prefill, decode)) as proxy:
                for stream in (False, True):
                    answer = httpx.post(proxy.url + "/v1/completions", json={**BODY, "stream": stream})
                    assert answer.status_code == 502, (prefill, decode, stream)
                    assert "could not be reached" in answer.json()["error"]["message"]
                if decode == closed:
                    assert httpx.get(proxy.url + "/v1/models").status_code == 502
        with ServerThread(build_proxy_app(down.url, up.url)) as proxy:
            assert httpx.post(proxy.url + "/v1/completions", json=BODY).status_code == 503


def test_a_stream_that_breaks_off_ends_with_an_error_event():
    seen: list = []
    with ServerThread(stub_server("prefill", seen)) as prefill, \
            ServerThread(stub_server("decode", seen, break_stream=True)) as decode, \
            ServerThread(build_proxy_app(prefill.url, decode.url)) as proxy:
        with httpx.stream("POST", proxy.url + "/v1/completions", json={**BODY, "stream": True}) as answer:
            events = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "decode"
    assert "broke off" in json.loads(events[1])["error"]["message"] and events[2:] == ["[DONE]"]


def test_the_prefill_request_drops_the_stream_options_and_the_decode_request_keeps_them(stubs):
    proxy, seen = stubs
    seen.clear()
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 8}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        assert "".join(answer.iter_text()).endswith("data: [DONE]\n\n")
    (_, _, _, prefill), (_, _, _, decode) = seen
    assert prefill["stream"] is False and "stream_options" not in prefill and prefill["max_tokens"] == 1
    assert "max_completion_tokens" not in prefill
    assert decode == body


def test_a_stream_with_usage_through_the_proxy_equals_the_server(server):
    """The real server behind the proxy: a stream asking for usage gets the text of the plain
    answer and, last, the usage chunk."""
    with ServerThread(build_proxy_app(server.url, server.url)) as proxy:
        plain = httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=60).json()
        body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as answer:
            assert answer.status_code == 200
            events = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
    assert chunks[-1]["usage"] == plain["usage"]
