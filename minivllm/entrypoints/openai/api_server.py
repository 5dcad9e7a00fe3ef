"""An OpenAI-compatible HTTP server over an `EngineClient` (FastAPI + uvicorn): by default the engine in its own process, or `AsyncLLMEngine` in this one.

Mirrors `vllm/entrypoints/openai/api_server.py` (v0, ~0.6). Routes:

    POST /v1/completions        POST /v1/chat/completions      (JSON, or SSE with "stream": true)
    GET  /v1/models             GET  /health                   GET  /metrics  (Prometheus text)
    POST /tokenize              POST /detokenize
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter   (--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING)

Any OpenAI client works against it:

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="tiny-shakespeare", prompt="ROMEO:", max_tokens=16)

Errors come back as OpenAI's JSON body `{"error": {"message", "type", "param", "code"}}`
(400 bad request, 401, 404, 413, 500 with only a request id, 503 while the engine process is
dead or frozen); a request never brings the server down. `build_app`'s keywords (`minivllm
serve`'s flags) `api_key`, `allowed_hosts`, `allowed_origins`, `max_body_bytes`,
`max_prompts_per_request` and `max_seqs_per_request` make it safe to share.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine, EngineStepError
from minivllm.engine.multiprocessing import MQEngineDeadError
from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.openai.cli_args import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_SEQS_PER_REQUEST,
)
from minivllm.entrypoints.openai.metrics import PrometheusStatLogger
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import OpenAIError, internal_error
from minivllm.entrypoints.openai.serving_models import (
    LoRAModulePath,
    OpenAIServingModels,
    runtime_lora_updating_allowed,
)

logger = logging.getLogger(__name__)

# How long `ServerThread.start` waits for uvicorn to bind before giving up.
_SERVER_START_TIMEOUT_S = 30.0
# Host header values of a server bound to loopback (a DNS-rebinding page sends its own name).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
API_KEY_ENV = "MINIVLLM_API_KEY"
# Routes anyone may call even with an API key set: liveness probes carry no credentials.
_OPEN_PATHS = ("/health",)


def build_app(
    engine: EngineClient,
    served_model_name: str | list[str] | None = None,
    *,
    api_key: str | None = None,
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
    allowed_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
    max_seqs_in_flight_per_request: int | None = None,
    lora_modules: Sequence[LoRAModulePath] = (),
) -> FastAPI:
    """A FastAPI app serving `engine`; registers a Prometheus stat logger on the engine.

    `served_model_name`: the name(s) clients put in `"model"` (default: the checkpoint folder's
    name, or the hub id). `allowed_hosts=None` accepts any Host header (a server bound to a
    public address, behind its own name). `lora_modules`: adapters served from the start
    (their names pick them in `"model"`; the engine needs enable_lora). The other arguments:
    see the module docstring.
    """
    names = _served_model_names(engine, served_model_name)
    models = OpenAIServingModels(engine, names, list(lora_modules))  # checks the adapters first
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger(registry, model_name=names[0])
    # One metrics logger per engine: a new app (a notebook cell run twice) takes it over.
    with contextlib.suppress(KeyError):
        engine.remove_logger("prometheus")
    engine.add_logger("prometheus", stat_logger)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start_background_loop()
        yield
        await engine.stop_background_loop()  # lets the current step finish, aborts the rest

    app = FastAPI(title="minivllm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.stat_logger = stat_logger
    _add_error_handlers(app)
    limits = dict(max_seqs_per_request=max_seqs_per_request, max_seqs_in_flight=max_seqs_in_flight_per_request)
    completion = OpenAIServingCompletion(engine, names, max_prompts_per_request, models, **limits)
    chat = OpenAIServingChat(engine, names, models=models, **limits)
    _add_openai_routes(app, completion, chat)
    if models.lora_enabled and runtime_lora_updating_allowed(os.environ):
        _add_lora_routes(app, models)
    _add_server_routes(app, engine, stat_logger)
    # The last one added runs first: Host, then CORS (its preflight carries no key), then the key.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    if allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    return app


def _served_model_names(engine: EngineClient, served_model_name: str | list[str] | None) -> list[str]:
    if served_model_name is None:
        # A local checkpoint is named by its folder ("tiny-shakespeare"); a hub id as it is.
        model = engine.model_config.model
        return [Path(model).name if Path(model).is_dir() else model]
    return [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)


# --------------------------------------------------------------------- routes
def _add_openai_routes(app: FastAPI, completion: OpenAIServingCompletion, chat: OpenAIServingChat) -> None:
    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return _answer(await completion.create_completion(request, raw_request.receive))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return _answer(await chat.create_chat_completion(request, raw_request.receive))

    @app.get("/v1/models")
    async def show_models() -> ModelList:
        return completion.models.show_available_models(completion.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of `prompt` and `messages`.", param="prompt")
        if request.messages is not None:
            tokens = await chat.render_chat(request.messages, request.add_generation_prompt)
        else:
            tokens = await chat.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=chat.max_model_len)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        chat.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=await chat.run_in_tokenizer_thread("decode", request.tokens))


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's run-time adapter routes (plain-text answers, as vLLM's)."""
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        return Response(await models.load_lora_adapter(request.lora_name, request.lora_path), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        return Response(await models.unload_lora_adapter(request.lora_name), media_type="text/plain")


def _answer(result) -> Response:
    """A pydantic response as JSON, or an async iterator of SSE events as a stream."""
    if hasattr(result, "model_dump_json"):
        # pydantic's JSON (not json.dumps): it writes a non-finite float as null instead of failing.
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream")


def _add_server_routes(app: FastAPI, engine: EngineClient, stat_logger: PrometheusStatLogger) -> None:
    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except RuntimeError as e:
            return _error_response(503, str(e), "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)


# --------------------------------------------------------------------- errors
def _error_response(status_code: int, message: str, error_type: str, param=None, code=None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status_code)

    @app.exception_handler(ValueError)
    async def value_error(_, exc: ValueError):  # e.g. the engine refusing a request
        return _error_response(400, str(exc), "invalid_request_error", param=getattr(exc, "param", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        # 400 as in vLLM (FastAPI's default is 422). Only locations and messages: echoing the
        # input back could carry undecodable bytes.
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        param = _first_field(exc.errors())
        return _error_response(400, f"Invalid request: {details}", "invalid_request_error", param=param)

    @app.exception_handler(EngineStepError)
    async def engine_error(_, exc: EngineStepError):  # the engine failed, not the request
        return _internal_error_response(exc)

    @app.exception_handler(MQEngineDeadError)
    async def engine_dead(_, exc: MQEngineDeadError):  # gone or frozen: no request can be served
        return _error_response(503, str(exc), "service_unavailable")

    @app.exception_handler(Exception)
    async def unexpected_error(_, exc: Exception):  # a bug of ours: log it, tell only an id
        return _internal_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):  # unknown route (404), wrong method (405), ...
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(exc.status_code, str(exc.detail), error_type)


def _internal_error_response(exc: BaseException) -> JSONResponse:
    request_id = f"err-{uuid.uuid4().hex[:12]}"
    logger.error("request %s failed", request_id, exc_info=exc)
    error = internal_error(request_id)
    return JSONResponse(error.to_response().model_dump(), status_code=error.status_code)


def _first_field(errors) -> str | None:
    """The request field an error is about ("body", "max_tokens") -> "max_tokens"."""
    for error in errors:
        fields = [p for p in error["loc"] if isinstance(p, str) and p != "body"]
        if fields:
            return fields[0]
    return None


# ---------------------------------------------------------------- middleware
class ApiKeyMiddleware:
    """Every HTTP route but `_OPEN_PATHS` needs `Authorization: Bearer <api_key>` (else 401).

    Plain ASGI rather than `@app.middleware("http")`: it leaves the request's `receive` alone,
    which the routes watch to notice a client that hangs up.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):  # constant time: no timing oracle
            await self.app(scope, receive, send)
            return
        # OpenAI's own answer to a bad key: 401, invalid_request_error, code invalid_api_key.
        response = _error_response(401, "Missing or wrong API key: send `Authorization: Bearer <key>`.",
                                   "invalid_request_error", code="invalid_api_key")
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse a request body over `max_body_bytes` with a 413, before it is all in memory:
    by its Content-Length header, or, for a chunked body, as soon as the bytes read pass it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large()(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                # Raised inside the route's body parsing, which passes FastAPI's HTTPException on.
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"The request body is larger than {self.max_body_bytes} bytes."

    def _too_large(self) -> JSONResponse:
        return _error_response(413, self._message(), "invalid_request_error")


# --------------------------------------------------------------- running it
class ServerThread:
    """uvicorn in a background thread, on a free port: for tests and notebooks.

    Example:
        >>> with ServerThread(build_app(engine)) as server:          # doctest: +SKIP
        ...     openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        # port 0: the OS picks a free port at bind time, so parallel servers never race for one.
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self.app = app
        self.server = uvicorn.Server(config)
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="minivllm-server", daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + _SERVER_START_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above).")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(args: argparse.Namespace) -> None:
    """`minivllm serve`: build the engine from the command line and serve until Ctrl-C.

    As vLLM v0.6: the engine runs in its own process (`MQLLMEngineClient`) unless
    --disable-frontend-multiprocessing keeps it in this one (`AsyncLLMEngine`).
    """
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.async_scheduling is None:
        # Off unless asked for (--async-scheduling): a run scheduled ahead is a whole
        # multi-step run, so a request that arrives meanwhile waits for it before its prefill,
        # and the server's throughput falls (docs/benchmarks.md).
        engine_args.async_scheduling = False
    engine = build_engine_client(engine_args, args.disable_frontend_multiprocessing)
    try:
        app = build_app(engine, args.served_model_name, **app_options(args, os.environ))
        logger.info("serving %s on http://%s:%d", engine.model_config.model, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        engine.shutdown()


def build_engine_client(engine_args: EngineArgs, disable_frontend_multiprocessing: bool = False):
    """The engine the server talks to: in another process (default) or in this one."""
    if disable_frontend_multiprocessing:
        return AsyncLLMEngine.from_engine_args(engine_args)
    from minivllm.engine.multiprocessing.client import MQLLMEngineClient

    return MQLLMEngineClient.from_engine_args(engine_args)


def app_options(args: argparse.Namespace, environ) -> dict:
    """`build_app`'s keyword arguments from the command line (and MINIVLLM_API_KEY)."""
    api_key = args.api_key or environ.get(API_KEY_ENV) or None
    if not api_key and not _is_loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who can reach it may use it", args.host)
    return dict(api_key=api_key, allowed_hosts=_allowed_hosts(args), allowed_origins=args.allowed_origins,
                max_body_bytes=args.max_request_body_bytes, max_prompts_per_request=args.max_prompts_per_request,
                max_seqs_per_request=args.max_seqs_per_request,
                max_seqs_in_flight_per_request=args.max_seqs_in_flight_per_request,
                lora_modules=args.lora_modules or [])


def _is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """--allowed-hosts if given; else the loopback names when bound to loopback; else any."""
    if args.allowed_hosts:
        return None if "*" in args.allowed_hosts else list(args.allowed_hosts)
    return [*LOOPBACK_HOSTS, args.host] if _is_loopback(args.host) else None


if __name__ == "__main__":
    from minivllm.entrypoints.openai.cli_args import make_arg_parser

    run_server(make_arg_parser().parse_args())
