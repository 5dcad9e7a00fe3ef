"""Command-line arguments of `minivllm serve` (light: no FastAPI import, so `--help` is fast).

Mirrors `vllm/entrypoints/openai/cli_args.py`: the server's own flags, then every engine
flag from `EngineArgs.add_cli_args`, with vLLM's names (`--model`, `--max-num-seqs`, ...).

    minivllm serve --host 127.0.0.1 --port 8000 --max-model-len 256
    MINIVLLM_API_KEY=... minivllm serve --host 0.0.0.0      (shared: every route needs the key)
    minivllm serve --enable-lora --lora-modules sql=/adapters/sql   (a request's "model": "sql")
"""

from __future__ import annotations

import argparse

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing a server to the network is a deliberate choice
DEFAULT_PORT = 8000
# 4 MiB: a full context of token ids as JSON for any model here, with room to spare.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
# Prompts x n (or best_of) of one request: one full step of the default max_num_seqs.
DEFAULT_MAX_SEQS_PER_REQUEST = 256


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's and the engine's arguments to `parser` (and return it)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=DEFAULT_HOST,
                       help="address to bind (default: %(default)s, loopback: only this machine can connect; "
                            "0.0.0.0 exposes the server to the network, so set --api-key too)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer <key>` on every route but /health "
                            "(default: the MINIVLLM_API_KEY environment variable; unset: no key)")
    group.add_argument("--allowed-hosts", nargs="+", default=None,
                       help="Host header values to accept, against DNS rebinding (default: the loopback names "
                            "when bound to loopback, else any; '*' accepts any)")
    group.add_argument("--allowed-origins", nargs="+", default=[],
                       help="origins allowed to read answers in a browser via CORS (default: none, "
                            "no CORS headers are sent)")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="larger request bodies get a 413 (default: %(default)s)")
    group.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                       help="most prompts one /v1/completions request may carry (default: %(default)s)")
    group.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                       help="most sequences one request may ask for, prompts x n (or best_of); more get a 400 "
                            "(default: %(default)s)")
    group.add_argument("--max-seqs-in-flight-per-request", type=int, default=None,
                       help="most sequences of one request in the engine at once; its other prompts wait and "
                            "queue as earlier ones finish, so later requests start meanwhile "
                            "(default: a quarter of --max-num-seqs)")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use in requests (default: the checkpoint folder's name, or the hub id)",
    )
    group.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                       help="LoRA adapters to serve, each as name=path to a PEFT folder; a request's "
                            "\"model\" picks one by name (needs --enable-lora; default: none)")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true",
                       help="run the engine inside the server's process (default: in its own process, "
                            "so the HTTP streams and the engine's steps do not share one GIL)")
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: %(default)s)",
    )
    from minivllm.engine.arg_utils import EngineArgs  # torch-free: only dataclasses and argparse

    EngineArgs.add_cli_args(parser)
    return parser


def _lora_module(text: str):
    """"name=path" -> LoRAModulePath (argparse turns the ValueError into a usage error)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    from minivllm.entrypoints.openai.serving_models import LoRAModulePath  # FastAPI-free only at call time

    return LoRAModulePath(name, path)


def make_arg_parser() -> argparse.ArgumentParser:
    """A stand-alone parser, for `python -m minivllm.entrypoints.openai.api_server`."""
    return add_serve_args(argparse.ArgumentParser(description="minivllm's OpenAI-compatible server"))
