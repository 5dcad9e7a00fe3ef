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

Needs httpx (`pip install minivllm[kv]`).
"""

from __future__ import annotations

import argparse
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

_FORWARDED_HEADERS = ("authorization",)


def build_proxy_app(prefill_url: str, decode_url: str, timeout_s: float | None = None) -> FastAPI:
    """The proxy for /v1/completions and /v1/chat/completions (other routes: the decode server)."""
    import httpx  # deferred: the proxy's only extra dependency

    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="minivllm prefill-decode proxy", lifespan=lifespan)

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        prefill = dict(body, max_tokens=1, stream=False)
        prefill.pop("max_completion_tokens", None)
        answer = await client.post(prefill_url + path, json=prefill, headers=headers)
        if answer.status_code != 200:  # a bad request: the client gets the prefill server's answer
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        if not body.get("stream"):
            answer = await client.post(decode_url + path, json=body, headers=headers)
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        upstream = await client.send(client.build_request("POST", decode_url + path, json=body, headers=headers),
                                     stream=True)
        return StreamingResponse(upstream.aiter_raw(), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"),
                                 background=BackgroundTask(upstream.aclose))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await client.get(decode_url + "/v1/models")
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    return app


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(build_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)
    return 0
