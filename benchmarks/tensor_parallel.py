"""Tensor parallelism on two GPUs: TP=2 against TP=1 on a Llama-3-8B-shaped model.

Two measurements, each system in its own process (so one's GPU memory never limits the next):

    full-batch     the same engine once all 256 requests decode: engine step time, and with
                   --profile-dir where a step's time goes (kernels, host, GPU idle on rank 0)
    throughput     nano-vllm's offline workload (the one benchmarks/common.py builds: 256
                   requests, prompts of 100-1024 random token ids, 100-1024 new tokens each,
                   EOS ignored, temperature 0.6 as nano-vllm's bench.py samples;
                   `--temperature 0`: greedy), output tokens per
                   second, every request checked to get exactly its max_tokens
    batch-1 decode one request with a 1024-token prompt; wall time per output token over
                   32 LLMEngine.step() calls after a warm-up (CUDA graphs on: at TP=2 the
                   graph holds the two all-reduces of every layer)

Systems (`--systems`): tp1, tp2 (the defaults: on GPUs the small all-reduces go through
symmetric memory, `minivllm/distributed/symm_mem.py`) and tp2-nccl (TP=2 with
`disable_custom_all_reduce=True`: NCCL does every all-reduce, to see what the custom one buys).

The model: benchmarks/configs/llama-3-8b (random weights, transformers `from_config`, seed 0,
bf16), saved once to a temporary directory. Targets: batch-1 decode step at TP=2
<= 0.65x TP=1, throughput at TP=2 >= 1.6x TP=1.

Both TP sizes run with the engine's defaults (8 decode steps per schedule on a GPU, TP or
not) unless `--num-scheduler-steps` says otherwise; the decode time is per token, since one
`step()` may produce several.

    python benchmarks/tensor_parallel.py --out benchmarks/results/   # needs 2 GPUs; -> tensor_parallel_<gpu>x2.json

NCCL on these machines needs NVLink multicast off; the script sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NCCL_ENV.items():
    os.environ.setdefault(_name, _value)

import common  # noqa: E402  (the workload, the checkpoint builder, Triton's cache, profiles)
import decode_latency  # noqa: E402  (the full-batch measurement, with this script's engine arguments)

MODEL = "llama-3-8b"
SYSTEMS = {"tp1": (1, False), "tp2": (2, False), "tp2-nccl": (2, True)}  # name -> (TP size, NCCL only)
DECODE_PROMPT_LEN, DECODE_STEPS, DECODE_WARMUP = 1024, 32, 4
TARGET_DECODE_RATIO, TARGET_THROUGHPUT_RATIO = 0.65, 1.6


def run_throughput(ckpt: Path, tp: int, num_seqs: int, enforce_eager: bool,
                   steps: int, temperature: float, nccl_only: bool) -> tuple[dict, Callable[[], None]]:
    from minivllm import LLM, SamplingParams

    prompts, max_tokens = common.make_workload(num_seqs)
    start = time.perf_counter()
    llm = LLM(model=str(ckpt), dtype="bfloat16", device="cuda", tensor_parallel_size=tp,
              max_model_len=common.MAX_MODEL_LEN, max_num_seqs=common.MAX_NUM_SEQS,
              max_num_batched_tokens=common.MAX_NUM_BATCHED_TOKENS,
              gpu_memory_utilization=common.GPU_MEMORY_UTILIZATION, enforce_eager=enforce_eager,
              num_scheduler_steps=steps, disable_custom_all_reduce=nccl_only)
    startup_s = time.perf_counter() - start
    inputs = [{"prompt_token_ids": p} for p in prompts]
    warmup = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=common.WARMUP_TOKENS,
                            detokenize=False)
    llm.generate(inputs[: common.WARMUP_REQUESTS], warmup, use_tqdm=False)
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m, detokenize=False)
              for m in max_tokens]
    timeline = common.StepTimeline()  # where each TP size's time goes: full batch, ramp-down, prefills
    llm.llm_engine.add_logger("timeline", timeline)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = common.checked_result([list(o.outputs[0].token_ids) for o in outputs], max_tokens, elapsed)
    result.update(startup_s=round(startup_s, 1), num_gpu_blocks=llm.llm_engine.cache_config.num_gpu_blocks,
                  temperature=temperature, timeline=timeline.summary(), stalls=timeline.stalls)
    return result, llm.llm_engine.shutdown


def run_decode(ckpt: Path, tp: int, enforce_eager: bool, steps: int, nccl_only: bool,
               profile_path: Path | None = None) -> tuple[dict, Callable[[], None]]:
    from minivllm import EngineArgs, LLMEngine, SamplingParams
    from minivllm.engine.profiler import TORCH_PROFILER_DIR_ENV

    every_rank = profile_path is not None and tp > 1
    if every_rank:  # where LLMEngine.start_profile writes each rank's trace
        os.environ.setdefault(TORCH_PROFILER_DIR_ENV, tempfile.mkdtemp(prefix="minivllm-traces-"))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(ckpt), dtype="bfloat16", device="cuda", tensor_parallel_size=tp, max_model_len=2048,
        max_num_seqs=8, gpu_memory_utilization=0.5, enforce_eager=enforce_eager, num_scheduler_steps=steps,
        disable_custom_all_reduce=nccl_only))
    prompt = {"prompt_token_ids": list(range(100, 100 + DECODE_PROMPT_LEN))}
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4096,
                                                   detokenize=False))
    engine.step()  # the prefill
    for _ in range(DECODE_WARMUP):
        engine.step()
    # A call may produce several tokens (multi-step): count tokens, not calls.
    request = engine.scheduler.running[0]
    tokens_before, start = request.first_seq.get_output_len(), time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()  # returns once its tokens are on the host
    elapsed, tokens = time.perf_counter() - start, request.first_seq.get_output_len() - tokens_before
    result = {"ms_per_token": round(1e3 * elapsed / tokens, 3), "tokens": tokens, "calls": DECODE_STEPS,
              "prompt_len": DECODE_PROMPT_LEN, "num_scheduler_steps": engine.scheduler_config.num_scheduler_steps}
    if profile_path is not None:
        # TP rank 0's kernels only (the other ranks run in their own processes): enough to
        # see the all-reduces' share of a step next to the GEMMs they follow.
        result["profile"] = common.profile_one_step(engine, request.first_seq, profile_path,
                                                            label=f"at batch 1, TP={tp} (rank 0)")
        if every_rank:  # both ranks over one step: the all-reduces' own time and each rank's waits
            result["every_rank"] = common.profile_every_rank(
                engine, profile_path.with_name(profile_path.stem + "_ranks.json"))
    engine.abort_request("0")
    return result, engine.shutdown


def run_full_batch(ckpt: Path, tp: int, enforce_eager: bool, steps: int, nccl_only: bool,
                   profile_dir: Path | None, name: str) -> tuple[dict, Callable[[], None]]:
    """The throughput run's engine once all 256 requests decode: engine step time, and with
    --profile-dir the kernels of one step, the host's cProfile and when TP rank 0's GPU idles
    (decode_latency.full_batch with this script's engine arguments)."""
    profile = profile_dir / f"profile_full_batch_{name}.txt" if profile_dir else None
    result = decode_latency.full_batch(
        str(ckpt), profile, tensor_parallel_size=tp, max_model_len=common.MAX_MODEL_LEN,
        max_num_seqs=common.MAX_NUM_SEQS, max_num_batched_tokens=common.MAX_NUM_BATCHED_TOKENS,
        gpu_memory_utilization=common.GPU_MEMORY_UTILIZATION, enforce_eager=enforce_eager,
        num_scheduler_steps=steps, disable_custom_all_reduce=nccl_only)
    return result, lambda: None  # full_batch's engine is gone with its LLM


def run_one(args) -> int:
    ckpt, (tp, nccl_only) = Path(args.ckpt), SYSTEMS[args.system]
    if args.kind == "throughput":
        result, shutdown = run_throughput(ckpt, tp, args.num_seqs, args.enforce_eager, args.num_scheduler_steps,
                                          args.temperature, nccl_only)
    elif args.kind == "full-batch":
        result, shutdown = run_full_batch(ckpt, tp, args.enforce_eager, args.num_scheduler_steps, nccl_only,
                                          Path(args.profile_dir) if args.profile_dir else None, args.system)
    else:
        profile = Path(args.profile_dir) / f"profile_batch1_{args.system}.txt" if args.profile_dir else None
        result, shutdown = run_decode(ckpt, tp, args.enforce_eager, args.num_scheduler_steps, nccl_only, profile)
    # The result is saved before the engine shuts down: a 2-GPU shutdown once hung in NCCL's
    # teardown, and a measurement must not be lost to it.
    Path(args.result).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    shutdown()
    return 0


def run_all(args) -> int:
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="minivllm-tp-"))
    print("== building the checkpoint", flush=True)
    ckpt = common.build_checkpoint(MODEL, tmp, "cuda")
    report = {"environment": common.environment("cuda"), "model": MODEL, "num_seqs": args.num_seqs,
              "cuda_graphs": not args.enforce_eager, "num_scheduler_steps": args.num_scheduler_steps,
              "temperature": args.temperature,
              "nccl_env": NCCL_ENV, "results": {}}
    for kind in args.kinds:
        for system in args.systems:
            result_file = tmp / f"{kind}-{system}.json"
            cmd = [sys.executable, __file__, "one", "--kind", kind, "--system", system, "--ckpt", str(ckpt),
                   "--result", str(result_file), "--num-seqs", str(args.num_seqs),
                   "--temperature", str(args.temperature),
                   *(["--num-scheduler-steps", str(args.num_scheduler_steps)] if args.num_scheduler_steps else []),
                   *(["--enforce-eager"] if args.enforce_eager else []),
                   *(["--profile-dir", args.profile_dir] if args.profile_dir else [])]
            print(f"== {kind}, {system}", flush=True)
            cached_before = set(common.triton_cache_entries())
            try:
                subprocess.run(cmd, timeout=args.timeout, check=False)
            except subprocess.TimeoutExpired:
                pass
            result = json.loads(result_file.read_text()) if result_file.exists() else {"error": "failed or timed out"}
            # Kernels this run compiled (the first run of a shape pays them; a stall may be one).
            compiled = sorted(set(common.triton_cache_entries()) - cached_before)
            result["triton_kernels_compiled_names"] = [common.kernel_name(entry) for entry in compiled]
            report["results"][f"{kind}-{system}"] = result
            common.result_path("tensor_parallel", report["environment"], out).write_text(json.dumps(report, indent=1))
    report["summary"] = summary(report["results"])
    common.result_path("tensor_parallel", report["environment"], out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0


def summary(results: dict) -> dict:
    def get(key, field):
        return results.get(key, {}).get(field)

    decode = [get(f"decode-{system}", "ms_per_token") for system in SYSTEMS]
    tput = [get(f"throughput-{system}", "output_tokens_per_s") for system in SYSTEMS]
    out = {"decode_ms_per_token": dict(zip(SYSTEMS, decode)), "output_tokens_per_s": dict(zip(SYSTEMS, tput))}
    for name, values in (("decode", decode), ("throughput", tput)):
        if values[0] and values[2]:  # the NCCL-only TP=2 run, for what the custom all-reduce buys
            out[f"{name}_ratio_tp2_nccl_over_tp1"] = round(values[2] / values[0], 3)
    if all(decode[:2]):
        out["decode_ratio_tp2_over_tp1"] = round(decode[1] / decode[0], 3)
        out["decode_target_met"] = out["decode_ratio_tp2_over_tp1"] <= TARGET_DECODE_RATIO
    if all(tput[:2]):
        out["throughput_ratio_tp2_over_tp1"] = round(tput[1] / tput[0], 3)
        out["throughput_target_met"] = out["throughput_ratio_tp2_over_tp1"] >= TARGET_THROUGHPUT_RATIO
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="all", choices=("all", "one"))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--num-seqs", type=int, default=common.NUM_SEQS)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (for both TP sizes)")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="for both TP sizes (default: the engine's, 8 on a GPU with CUDA graphs)")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="throughput: sampling temperature (default: nano-vllm bench.py's 0.6; 0: greedy)")
    parser.add_argument("--kinds", nargs="+", default=["decode", "throughput"],
                        choices=("decode", "throughput", "full-batch"),
                        help="which measurements `all` runs")
    parser.add_argument("--profile-dir", default=None,
                        help="decode, full-batch: also a torch.profiler table of one step on TP rank 0 "
                             "(full-batch: and the host's cProfile and the GPU-idle profile), per TP size")
    parser.add_argument("--kind", choices=("throughput", "decode", "full-batch"))
    parser.add_argument("--systems", nargs="+", default=["tp1", "tp2"], choices=tuple(SYSTEMS),
                        help="which systems `all` measures, in this order")
    parser.add_argument("--system", choices=tuple(SYSTEMS))
    parser.add_argument("--ckpt")
    parser.add_argument("--result")
    args = parser.parse_args(argv)
    return run_one(args) if args.command == "one" else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
