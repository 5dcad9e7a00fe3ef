"""The `minivllm` command: `generate`, `bench` and `serve`.

    minivllm generate "ROMEO:" "JULIET:" --max-tokens 64 --temperature 0.8
    minivllm bench --num-seqs 16 --max-input-len 64 --max-output-len 64
    minivllm serve tiny-shakespeare --port 8000      (or --model, as vLLM accepts both)

Also `python -m minivllm ...`. Every engine argument (`--model`, `--block-size`,
`--enable-prefix-caching`, ...) works with every sub-command, and `--help` shows each
default. Heavy imports (torch, transformers, FastAPI) happen only once a sub-command runs,
so `--help` is instant; a sub-command checks its own arguments before it loads a model.

A mistake the user can fix (a bad value, a missing folder, no GPU) is printed as one line,
`minivllm generate: error: ...`, with exit status 1; `--debug` (or `MINIVLLM_DEBUG=1`)
shows the traceback instead. A malformed command line (an unknown flag, a missing prompt) is
one line too, with argparse's exit status 2, instead of the whole usage.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from minivllm.engine.arg_utils import EngineArgs

DEBUG_ENV = "MINIVLLM_DEBUG"
# Exceptions that mean "the input was wrong" (our ValueErrors, a missing file, a missing
# extra), as opposed to a bug in minivllm, whose traceback is always shown.
USER_ERRORS = (ValueError, OSError, ImportError)
EXIT_USER_ERROR = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C
EXIT_USAGE = 2  # argparse's code for a malformed command line
# What `pip install minivllm[serve]` adds (and what it pulls in), for the hint when one is missing.
SERVE_EXTRA_MODULES = ("fastapi", "uvicorn", "prometheus_client", "starlette", "pydantic")


@dataclass(frozen=True)
class BenchWorkload:
    """Random prompts of min_len..max_input_len token ids, min_len..max_output_len new tokens each."""

    num_seqs: int
    min_len: int
    max_input_len: int
    max_output_len: int


# nano-vllm's offline benchmark (bench.py): 256 requests, random prompt token ids of 100-1024
# tokens, 100-1024 new tokens each, EOS ignored, seed 0. The GPU default.
GPU_BENCH = BenchWorkload(num_seqs=256, min_len=100, max_input_len=1024, max_output_len=1024)
# Without a GPU the same workload takes many minutes; this one takes seconds on a laptop core.
CPU_BENCH = BenchWorkload(num_seqs=16, min_len=16, max_input_len=128, max_output_len=128)
BENCH_SEED = 0
# Token ids are drawn in [0, 10000], as nano-vllm does (valid for Qwen3's vocabulary).
BENCH_MAX_TOKEN_ID = 10000


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug or os.environ.get(DEBUG_ENV) == "1":
            raise
        message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the source
        print(f"minivllm {args.command}: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, except that a mistake prints one line: the engine's flags make the usage that
    argparse prints before the message about 40 lines long, and the message is what matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def make_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog="minivllm", description="minivllm: a small, readable vLLM.")
    parser.add_argument("--version", action="version", version=f"minivllm {_installed_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (or set {DEBUG_ENV}=1)")

    def add_command(name: str, help_text: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help_text, description=help_text, parents=[common])

    generate = add_command("generate", "generate text for one or more prompts")
    generate.add_argument("prompts", nargs="+", help="prompt text(s)")
    generate.add_argument("--max-tokens", type=int, default=64, help="most new tokens per completion "
                          "(it ends sooner at the model's EOS token) (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)")
    generate.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default: %(default)s)")
    generate.add_argument("--top-k", type=int, default=-1, help="-1 disables (default: %(default)s)")
    generate.add_argument("--n", type=int, default=1, help="completions per prompt (default: %(default)s)")
    generate.add_argument("--sampling-seed", type=int, default=None,
                          help="per-request seed, for reproducible samples (default: the engine's RNG)")
    generate.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens even past EOS")
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=run_generate)

    bench = add_command("bench", "offline throughput benchmark (nano-vllm's workload on a GPU)")
    for name, help_text in (("num-seqs", "requests"), ("min-len", "shortest prompt and output"),
                            ("max-input-len", "longest prompt"), ("max-output-len", "longest output")):
        field = name.replace("-", "_")
        bench.add_argument(f"--{name}", type=int, default=None,
                           help=f"{help_text} (default: {getattr(GPU_BENCH, field)} on a GPU, "
                                f"{getattr(CPU_BENCH, field)} on a CPU)")
    bench.add_argument("--no-progress", dest="use_tqdm", action="store_false", help="no progress bar")
    EngineArgs.add_cli_args(bench)
    bench.set_defaults(func=run_bench)

    serve = add_command("serve", "OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model to serve, as in `vllm serve MODEL` (the same as --model)")
    from minivllm.entrypoints.openai.cli_args import add_serve_args  # light: no FastAPI

    add_serve_args(serve)
    serve.set_defaults(func=run_serve)

    proxy = add_command("proxy", "prefill-decode disaggregation: each request's prefill on one server, "
                                 "its decode on another")
    proxy.set_defaults(func=_run_proxy)
    _add_proxy_args(proxy)
    return parser


def _add_proxy_args(parser: argparse.ArgumentParser) -> None:
    from minivllm.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES  # light: no FastAPI

    parser.add_argument("--prefill", required=True, help="the prefill server's URL (kv_role kv_producer)")
    parser.add_argument("--decode", required=True, help="the decode server's URL (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument("--allowed-hosts", nargs="+", default=None,
                        help="Host header values to accept, against DNS rebinding (default: the loopback names "
                             "when bound to loopback, else any; '*' accepts any)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get a 413 (default: %(default)s)")


def _run_proxy(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.disagg_proxy import run_proxy  # deferred: FastAPI, httpx

    return run_proxy(args)


def _installed_version() -> str:
    # From the installed package's metadata (pyproject.toml's version), not `minivllm.__version__`:
    # an entry point imports nothing above it (tests/test_architecture.py).
    try:
        return importlib.metadata.version("minivllm")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


# ----------------------------------------------------------------------------- generate

def run_generate(args: argparse.Namespace) -> int:
    from minivllm.sampling_params import SamplingParams

    # Built first: a bad value fails here, in milliseconds, before the model loads.
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
    )
    if any(not prompt for prompt in args.prompts):
        raise ValueError("a prompt is empty: give at least one character.")
    from minivllm.entrypoints.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    for output in llm.generate(args.prompts, params, use_tqdm=False):
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print("-" * 40)
    return 0


# ----------------------------------------------------------------------------- bench

def run_bench(args: argparse.Namespace) -> int:
    from minivllm.config import DeviceConfig  # torch, but no model yet

    device = DeviceConfig(args.device).device_type
    workload = bench_workload_from_args(args, GPU_BENCH if device == "cuda" else CPU_BENCH)
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    prompts, output_lens = bench_workload(workload.num_seqs, workload.min_len, workload.max_input_len,
                                          workload.max_output_len)
    # A model with a smaller vocabulary or context gets the same draw, folded into its limits.
    vocab_size = llm.llm_engine.vocab_size
    max_model_len = llm.llm_engine.scheduler_config.max_model_len
    prompts = [[t % vocab_size for t in p[: max_model_len - 1]] for p in prompts]
    output_lens = [min(n, max_model_len - len(p)) for p, n in zip(prompts, output_lens)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=args.use_tqdm)  # the bar goes to stderr
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model": llm.llm_engine.model_config.model,
        "device": llm.llm_engine.device_config.device,
        "num_seqs": workload.num_seqs,
        "input_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
    }
    print(json.dumps(result))
    return 0


def bench_workload_from_args(args: argparse.Namespace, default: BenchWorkload) -> BenchWorkload:
    """The flags given, the device's default workload for the rest; checked before any model loads."""
    values = {name: getattr(args, name) if getattr(args, name) is not None else getattr(default, name)
              for name in ("num_seqs", "min_len", "max_input_len", "max_output_len")}
    workload = BenchWorkload(**values)
    if workload.num_seqs < 1 or workload.min_len < 1:
        raise ValueError(f"--num-seqs and --min-len must be at least 1, got {workload.num_seqs} "
                         f"and {workload.min_len}.")
    if workload.min_len > min(workload.max_input_len, workload.max_output_len):
        raise ValueError(f"--min-len ({workload.min_len}) must be at most --max-input-len "
                         f"({workload.max_input_len}) and --max-output-len ({workload.max_output_len}).")
    return workload


def bench_workload(num_seqs: int, min_len: int, max_input_len: int,
                   max_output_len: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draw, in its order (all prompts, then all output lengths), from
    `random.seed(0)`: at the GPU defaults 142,827 prompt and 133,966 output tokens."""
    rng = random.Random(BENCH_SEED)
    prompts = [[rng.randint(0, BENCH_MAX_TOKEN_ID) for _ in range(rng.randint(min_len, max_input_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_output_len) for _ in range(num_seqs)]
    return prompts, output_lens


# ----------------------------------------------------------------------------- serve

def run_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one.")
        args.model = args.model_tag
    try:
        from minivllm.entrypoints.openai.api_server import run_server
    except ModuleNotFoundError as e:  # FastAPI / uvicorn come with the serve extra
        if (e.name or "").split(".")[0] not in SERVE_EXTRA_MODULES:
            raise
        raise ImportError(f"minivllm serve needs the 'serve' extra ({e.name} is missing): "
                          "pip install 'minivllm[serve]' (from a clone: pip install -e '.[serve]').") from e

    run_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
