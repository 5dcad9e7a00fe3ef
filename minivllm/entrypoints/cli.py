"""The `minivllm` command: `generate`, `bench` and `serve`.

    minivllm generate "ROMEO:" "JULIET:" --max-tokens 64 --temperature 0.8
    minivllm bench --num-seqs 16 --max-input-len 64 --max-output-len 64
    minivllm serve --port 8000

Also `python -m minivllm ...`. Every engine argument (`--model`, `--block-size`,
`--enable-prefix-caching`, ...) works with every sub-command. Heavy imports (torch,
transformers, FastAPI) happen only once a sub-command runs, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from minivllm.engine.arg_utils import EngineArgs

# nano-vllm's offline benchmark (bench.py): 256 requests, random prompt token ids of 100-1024
# tokens, 100-1024 new tokens each, EOS ignored, seed 0.
BENCH_NUM_SEQS = 256
BENCH_MIN_LEN = 100
BENCH_MAX_INPUT_LEN = 1024
BENCH_MAX_OUTPUT_LEN = 1024
BENCH_SEED = 0
# Token ids are drawn in [0, 10000], as nano-vllm does (valid for Qwen3's vocabulary).
BENCH_MAX_TOKEN_ID = 10000


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    return args.func(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="minivllm: a small, readable vLLM.")
    subparsers = parser.add_subparsers(dest="command", required=True)

    generate = subparsers.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("prompts", nargs="+", help="prompt text(s)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-p", type=float, default=0.95)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--n", type=int, default=1, help="completions per prompt")
    generate.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible)")
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=run_generate)

    bench = subparsers.add_parser("bench", help="offline throughput benchmark (nano-vllm's workload)")
    bench.add_argument("--num-seqs", type=int, default=BENCH_NUM_SEQS)
    bench.add_argument("--min-len", type=int, default=BENCH_MIN_LEN, help="shortest prompt and output")
    bench.add_argument("--max-input-len", type=int, default=BENCH_MAX_INPUT_LEN)
    bench.add_argument("--max-output-len", type=int, default=BENCH_MAX_OUTPUT_LEN)
    EngineArgs.add_cli_args(bench)
    bench.set_defaults(func=run_bench)

    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    from minivllm.entrypoints.openai.cli_args import add_serve_args  # light: no FastAPI

    add_serve_args(serve)
    serve.set_defaults(func=run_serve)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed,
    )
    for output in llm.generate(args.prompts, params, use_tqdm=False):
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print("-" * 40)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    prompts, output_lens = bench_workload(args.num_seqs, args.min_len, args.max_input_len, args.max_output_len)
    # A model with a smaller vocabulary or context gets the same draw, folded into its limits.
    vocab_size = llm.llm_engine.vocab_size
    max_model_len = llm.llm_engine.scheduler_config.max_model_len
    prompts = [[t % vocab_size for t in p[: max_model_len - 1]] for p in prompts]
    output_lens = [min(n, max_model_len - len(p)) for p, n in zip(prompts, output_lens)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model": llm.llm_engine.model_config.model,
        "device": llm.llm_engine.device_config.device,
        "num_seqs": args.num_seqs,
        "input_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
    }
    print(json.dumps(result))
    return 0


def bench_workload(num_seqs: int, min_len: int, max_input_len: int,
                   max_output_len: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draw, in its order (all prompts, then all output lengths), from
    `random.seed(0)`: at the defaults 142,827 prompt and 133,966 output tokens."""
    rng = random.Random(BENCH_SEED)
    prompts = [[rng.randint(0, BENCH_MAX_TOKEN_ID) for _ in range(rng.randint(min_len, max_input_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_output_len) for _ in range(num_seqs)]
    return prompts, output_lens


def run_serve(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.openai.api_server import run_server

    run_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
