"""Command-line arguments of `minivllm serve` (light: no FastAPI import, so `--help` is fast).

Mirrors `vllm/entrypoints/openai/cli_args.py`: the server's own flags, then every engine
flag from `EngineArgs.add_cli_args`, with vLLM's names (`--model`, `--max-num-seqs`, ...).

    minivllm serve --host 127.0.0.1 --port 8000 --max-model-len 256
"""

from __future__ import annotations

import argparse

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing a server to the network is a deliberate choice
DEFAULT_PORT = 8000


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's and the engine's arguments to `parser` (and return it)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (default: %(default)s)")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use in requests (default: the checkpoint folder's name, or the hub id)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: %(default)s)",
    )
    from minivllm.engine.arg_utils import EngineArgs  # torch-free: only dataclasses and argparse

    EngineArgs.add_cli_args(parser)
    return parser


def make_arg_parser() -> argparse.ArgumentParser:
    """A stand-alone parser, for `python -m minivllm.entrypoints.openai.api_server`."""
    return add_serve_args(argparse.ArgumentParser(description="minivllm's OpenAI-compatible server"))
