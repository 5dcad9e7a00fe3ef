"""`minivllm proxy`: prefill on one server, decode on another (prefill-decode disaggregation).

vLLM's disaggregated-prefill examples put the same small proxy in front of two instances:

    client --> proxy --(1) the request with max_tokens=1--> prefill server (kv_role="kv_producer")
                     |                                     computes the prompt's KV, saves it
                     |                                     to the shared store, returns 1 token
                     +--(2) the request as it came-------> decode server (kv_role="kv_consumer")
                                                           loads the prompt's KV from the store,
                                                           computes only the last partial block,
                                                           decodes; its answer goes to the client

Both servers name the same store in `--kv-transfer-config`; a long prefill then never stalls
the decode server's running requests.

    minivllm serve --port 8100 --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
    minivllm serve --port 8200 --kv-transfer-config '{... "kv_role": "kv_consumer" ...}'
    minivllm proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

The proxy guards itself as the server does (a Host check, a body limit: `--allowed-hosts`,
`--max-request-body-bytes`) and passes the client's API key on to both servers.
Needs httpx (`pip install minivllm[kv]`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from minivllm.entrypoints.openai.api_server import (LOOPBACK_HOSTS, BodySizeLimitMiddleware, _add_error_handlers,
                                                    _allowed_hosts)
from minivllm.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES
from minivllm.entrypoints.openai.serving_engine import OpenAIError, sse_event

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization",)  # the client's API key reaches both servers
# What the prefill request must not carry: it asks for one token, as a plain answer.
_PREFILL_DROPPED = ("max_completion_tokens", "stream_options")


def build_proxy_app(
    prefill_url: str,
    decode_url: str,
    timeout_s: float | None = None,
    *,
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The proxy for /v1/completions and /v1/chat/completions, and /v1/models (the decode server's).

    `allowed_hosts` and `max_body_bytes` as the server's (`build_app`); the API key is the
    servers' to check, so the client's `Authorization` header goes to both. Errors have the
    server's JSON shape: 400 for a body that is not a JSON object, 413 over the limit, 502 for
    a server that cannot be reached; a server's own error answer comes back as it is.
    """
    import httpx  # deferred: the proxy's only extra dependency

    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="minivllm prefill-decode proxy", lifespan=lifespan)
    _add_error_handlers(app)

    async def send(role: str, method: str, url: str, headers: dict, body: dict | None = None, stream: bool = False):
        try:
            return await client.send(client.build_request(method, url, json=body, headers=headers), stream=stream)
        except httpx.HTTPError as e:  # refused, reset, timed out: the client hears which server, not why
            logger.warning("the %s server (%s) could not be reached: %r", role, url, e)
            raise OpenAIError(f"The {role} server could not be reached.", 502) from None

    async def forward(path: str, request: Request) -> Response:
        body = await _json_object(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        prefill = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED} | {"max_tokens": 1, "stream": False}
        answer = await send("prefill", "POST", prefill_url + path, headers, prefill)
        if answer.status_code != 200:  # a bad request: the client gets the prefill server's answer
            return _relayed(answer)
        if not body.get("stream"):
            return _relayed(await send("decode", "POST", decode_url + path, headers, body))
        upstream = await send("decode", "POST", decode_url + path, headers, body, stream=True)
        return StreamingResponse(_relay_stream(upstream, httpx.HTTPError), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        return _relayed(await send("decode", "GET", decode_url + "/v1/models", headers))

    # The last one added runs first: the Host check, then the body limit.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    return app


async def _json_object(request: Request) -> dict:
    """The request's body as a dict, or a 400 that says why not (the body limit applies while reading)."""
    try:
        body = json.loads(await request.body())
    except ValueError as e:  # not JSON, or not UTF-8
        raise OpenAIError(f"The request body is not valid JSON: {e}", 400) from None
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.", 400)
    return body


def _relayed(answer) -> Response:
    return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))


async def _relay_stream(upstream, http_error: type[Exception]) -> AsyncIterator[bytes]:
    """The decode server's stream as it comes; if it breaks off, an error event ends it."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except http_error as e:
        logger.warning("the decode server's stream broke off: %r", e)
        error = OpenAIError("The decode server's stream broke off.", 502).to_response()
        yield ("\n\n" + sse_event(error) + "data: [DONE]\n\n").encode()
    finally:
        await upstream.aclose()


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), allowed_hosts=_allowed_hosts(args),
                          max_body_bytes=args.max_request_body_bytes)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0
