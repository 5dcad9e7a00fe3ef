"""Decode step latency against the memory-bandwidth floor (and, optionally, where it goes).

A decode step reads every weight once and every cached key/value of the batch once, and does
little arithmetic per byte, so its floor is a bandwidth one:

    floor = (weight bytes + KV bytes) / copy bandwidth
    KV bytes = batch x context x layers x 2 (K and V) x num_kv_heads x head_dim x dtype bytes

The copy bandwidth is measured here (a 1 GiB device-to-device copy, bytes read + written,
best of 3). We time, at batch 1 and batch 256, context 1024 (prompts of 1024 tokens, then
decode), for CUDA graphs, eager, and CUDA graphs without the fused Triton elementwise ops
(their `forward_native` PyTorch code, to show what fusion buys):

    forward       the model's decode forward alone: CUDA-graph replay timed with CUDA events
                  (graphs), or the eager forward (eager)
    engine step   LLMEngine.step() wall time: schedule, prepare inputs, forward, LM head,
                  sampling, output processing (what a user waits for)

    python benchmarks/decode_latency.py --ckpt /tmp/qwen3-0.6b --result out.json [--profile-dir d]

--profile-dir writes torch.profiler tables (GPU kernels) and a cProfile of engine.step()
(the Python side) at batch 256.

--batch1 measures batch 1 with `LLM()` defaults instead: the median decode step,
time per output token through LLM.generate (128-token prompt, 512 greedy tokens) and a
torch.profiler table of one decode step (profile_batch1_decode_step.txt in --profile-dir).
--full-batch steps the headline's 256 requests (temperature 0.6, `LLM()` defaults) until all
decode, then times and profiles full-batch engine steps. benchmarks/nano_vllm_workload.py runs
both as rows of its table.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch
from common import (HOST_PROFILE_STEPS, IDLE_PROFILE_STEPS, NANO_MAX_MODEL_LEN, cuda_median_ms, engine_args_used, gpu_clocks,
                    make_workload, profile_every_rank, profile_gpu_idle, profile_host, profile_one_step,
                    resolved_engine_settings)

CONTEXT = int(os.environ.get("DECODE_CONTEXT", "1024"))
BATCH_SIZES = tuple(int(b) for b in os.environ.get("DECODE_BATCH_SIZES", "1,256").split(","))
MEASURE_STEPS = 20  # decode steps timed per configuration
WARMUP_STEPS = 3
COPY_BYTES = 1 << 30
COPY_ROUNDS = 3
BLOCK_SIZE = 16
PROFILE_STEPS = 5
MAX_MODEL_LEN = 2048
MODES = ["graphs", "eager", "graphs-unfused", "graphs-8step"]
MULTI_STEP = 8  # num_scheduler_steps of mode "graphs-8step"


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    if not device.startswith("cuda"):
        return 2e10  # CPU smoke tests only: a nominal figure
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(COPY_ROUNDS):
        dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 5 / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Every parameter once (a tied LM head shares the embedding's storage)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes(hf_config, batch: int, context: float, dtype_bytes: int) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return int(batch * context * hf_config.num_hidden_layers * 2 * hf_config.num_key_value_heads * head_dim * dtype_bytes)


def make_llm(ckpt: str, device: str, enforce_eager: bool, max_batch: int, num_scheduler_steps: int = 1):
    from minivllm import LLM

    steps = WARMUP_STEPS + MEASURE_STEPS + PROFILE_STEPS * 3
    blocks_per_seq = -(-(CONTEXT + steps * num_scheduler_steps + 64) // BLOCK_SIZE)
    return LLM(model=ckpt, dtype="bfloat16", device=device, enforce_eager=enforce_eager, block_size=BLOCK_SIZE,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=max_batch, max_num_batched_tokens=16384,
               num_gpu_blocks_override=max_batch * blocks_per_seq + 16, num_scheduler_steps=num_scheduler_steps)


def start_batch(llm, batch: int) -> None:
    """Add `batch` requests with CONTEXT-token prompts and step until all are decoding."""
    from minivllm import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_MODEL_LEN - CONTEXT, detokenize=False)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": [rng.randrange(10000) for _ in range(CONTEXT)]}, params)
    while any(seq_group.is_prefill() for seq_group in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()


def time_engine_steps(engine, steps: int) -> float:
    """Median wall time of engine.step() in ms (step() ends by reading the sampled tokens: synced)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def time_forward(llm, batch: int, enforce_eager: bool) -> float:
    """Median GPU time of the decode forward (ms) on the batch the last step ran."""
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    # The graph runner may sit under a multi-step one (`base`); a CPU engine captures no graphs.
    graph_runners = getattr(getattr(runner, "base", runner), "graph_runners", None)
    if not enforce_eager and graph_runners:
        graph = graph_runners[min(s for s in graph_runners if s >= batch)].graph
        fn = graph.replay
    else:
        fn = _eager_forward(llm, batch)
    return cuda_median_ms(fn, MEASURE_STEPS)


def _eager_forward(llm, batch: int):
    """A closure re-running the model on the running batch (its K/V writes land in its own slots)."""
    engine = llm.llm_engine
    worker = engine.model_executor.driver_worker
    runner = worker.model_runner
    seq_group_metadata_list, _, _ = engine.scheduler.schedule()
    model_input = runner.prepare_model_input(seq_group_metadata_list)
    return lambda: runner.model(model_input.input_ids, model_input.positions, worker.kv_caches,
                                model_input.attn_metadata)


def profile_steps(llm, label: str, profile_dir: Path) -> None:
    """torch.profiler kernel table and a cProfile of the Python side, over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    profile_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
    table = prof.key_averages().table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total", row_limit=30, max_name_column_width=60)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILE_STEPS):
        engine.step()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    with open(profile_dir.parent / f"profile_{profile_dir.name}.txt", "a") as f:
        f.write(f"\n\n######## {label}: torch.profiler, {PROFILE_STEPS} steps\n{table}\n")
        f.write(f"\n######## {label}: cProfile of engine.step(), {PROFILE_STEPS} steps\n{stream.getvalue()}\n")


def use_pytorch_elementwise_ops(engine) -> None:
    """Rebind every fused layer (RMSNorm, SiLU-and-mul, rotary, the greedy pick) to its PyTorch
    `forward_native`, then capture the decode graphs again with them."""
    from minivllm.model_executor.custom_op import CustomOp

    worker = engine.model_executor.driver_worker
    runner = worker.model_runner
    for module in [*runner.model.modules(), *runner.sampler.modules()]:
        if isinstance(module, CustomOp):
            module.use_backend("torch")
    runner.capture_model(worker.kv_caches)


def measure(ckpt: str, device: str, mode: str, bandwidth: float, profile_dir: Path | None) -> dict:
    """mode: "graphs", "eager" (enforce_eager), "graphs-unfused" (CUDA graphs, but the
    PyTorch RMSNorm / SiLU / rotary instead of the fused Triton ops: before/after fusion), or
    "graphs-8step" (num_scheduler_steps=8: engine_step_ms is then one step() / 8, the engine
    time per token)."""
    enforce_eager = mode == "eager"
    tokens_per_step = MULTI_STEP if mode == "graphs-8step" else 1
    llm = make_llm(ckpt, device, enforce_eager, max(BATCH_SIZES), tokens_per_step)
    engine = llm.llm_engine
    if mode == "graphs-unfused":
        use_pytorch_elementwise_ops(engine)
    model = engine.model_executor.driver_worker.model_runner.model
    hf_config = engine.model_config.hf_config
    weights = weight_bytes(model)
    results = {}
    for batch in BATCH_SIZES:
        start_batch(llm, batch)
        step_ms = time_engine_steps(engine, MEASURE_STEPS) / tokens_per_step
        forward_ms = time_forward(llm, batch, enforce_eager)
        # The floor at the context the forward was timed at: prompts of CONTEXT tokens plus
        # what warm-up and the timed steps generated (8 tokens a step in "graphs-8step").
        context = sum(g.first_seq.get_len() for g in engine.scheduler.running) / batch
        kv = kv_bytes(hf_config, batch, context, 2)
        floor_ms = 1e3 * (weights + kv) / bandwidth
        results[f"batch_{batch}"] = {
            "context": round(context, 1), "forward_ms": round(forward_ms, 3), "engine_step_ms": round(step_ms, 3),
            "tokens_per_engine_step": tokens_per_step,
            "weight_bytes": weights, "kv_bytes": kv, "floor_ms": round(floor_ms, 3),
            "forward_over_floor": round(forward_ms / floor_ms, 2), "step_over_floor": round(step_ms / floor_ms, 2),
        }
        print(mode, batch, results[f"batch_{batch}"], flush=True)
        if profile_dir is not None and batch == max(BATCH_SIZES) and mode in ("graphs", "graphs-8step"):
            profile_steps(llm, f"{mode}, batch {batch} x context {CONTEXT}", profile_dir)
        engine.abort_request([g.request_id for g in list(engine.scheduler.running) + list(engine.scheduler.waiting)])
        engine.step()
    del llm, engine, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------- batch 1 and the full batch, LLM() defaults
B1_PROMPT_LEN, B1_STEPS, B1_WARMUP_STEPS, B1_GEN_TOKENS, B1_REPS = 128, 64, 8, 512, 3
B1_MAX_MODEL_LEN = NANO_MAX_MODEL_LEN  # as nano-vllm's bench.py
FULL_STEPS = 6  # engine steps timed at the full batch (each several tokens with multi-step)


def use_cublas_linear(engine) -> None:
    """Every linear layer's matmul through F.linear (cuBLAS), the decode graphs captured again:
    the Triton GEMV's peer at batch 1, in the same run."""
    from minivllm.model_executor.layers.linear import UnquantizedLinearMethod

    worker = engine.model_executor.driver_worker
    for module in worker.model_runner.model.modules():
        if isinstance(module, UnquantizedLinearMethod):
            module.use_backend("torch")
    worker.model_runner.capture_model(worker.kv_caches)


def without_programmatic_launch() -> None:
    """Every kernel launched plainly, after the one before it has finished (no PDL), in this
    process: the batch-1 row's diagnostic of what programmatic dependent launch wins."""
    from minivllm.kernels import launch

    launch.programmatic_launch = lambda device: False


def batch1(ckpt: str, profile_path: Path | None, smoke: bool = False, cublas_linear: bool = False,
           pdl: bool = True) -> dict:
    """Batch-1 latency with `LLM()` defaults (model, dtype, max_model_len only):

    decode step   median wall time of LLMEngine.step() over B1_STEPS decode steps of one request
                  (128-token prompt) after warm-up; with multi-step defaults one step() yields
                  several tokens, so ms per token = total time / tokens those steps produced
    TPOT          through LLM.generate: (time of 512 greedy tokens - time of 1 token) / 511,
                  each the median of B1_REPS runs (the difference removes the prefill and TTFT)
    profile       torch.profiler over one decode step(): top kernels by GPU time, kernel count
    cublas_linear: every linear layer through cuBLAS rather than the one-token Triton GEMV
    pdl=False: no programmatic dependent launch (`kernels/launch.py`)
    """
    from minivllm import LLM, SamplingParams

    steps, gen_tokens = (8, 16) if smoke else (B1_STEPS, B1_GEN_TOKENS)
    given = {"model": ckpt, "dtype": "float32" if smoke else "bfloat16", "max_model_len": B1_MAX_MODEL_LEN}
    if not pdl:
        without_programmatic_launch()
    llm = LLM(**given)
    engine = llm.llm_engine
    if cublas_linear:
        use_cublas_linear(engine)
    prompt = {"prompt_token_ids": [random.Random(1).randrange(10000) for _ in range(B1_PROMPT_LEN)]}
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([prompt], SamplingParams(**greedy, max_tokens=gen_tokens), use_tqdm=False)  # warm-up
    result = {"engine_args": engine_args_used(given), "engine_resolved": resolved_engine_settings(engine),
              "prompt_len": B1_PROMPT_LEN, "num_scheduler_steps": engine.scheduler_config.num_scheduler_steps,
              "linear": "cuBLAS" if cublas_linear else "Triton GEMV", "programmatic_launch": pdl}
    engine.add_request("b1", prompt, SamplingParams(**greedy, max_tokens=B1_MAX_MODEL_LEN - B1_PROMPT_LEN - 64))
    while not engine.scheduler.running or engine.scheduler.running[0].is_prefill():
        engine.step()
    seq = engine.scheduler.running[0].first_seq
    for _ in range(B1_WARMUP_STEPS):
        engine.step()
    times, tokens = [], []
    with gpu_clocks(str(engine.device_config.device)) as clocks:
        for _ in range(steps):
            before, start = seq.get_output_len(), time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            tokens.append(seq.get_output_len() - before)
    result.update(gpu_clocks=clocks, decode_step_ms_median=round(1e3 * sorted(times)[len(times) // 2], 4),
                  tokens_per_step_median=sorted(tokens)[len(tokens) // 2],
                  decode_ms_per_token=round(1e3 * sum(times) / max(1, sum(tokens)), 4),
                  decode_steps_timed=steps, target_decode_ms=1.0)
    if profile_path is not None:
        result["profile"] = profile_one_step(engine, seq, profile_path)
        result["host_profile"] = profile_host(engine, 2 if smoke else 3 * HOST_PROFILE_STEPS,
                                              profile_path.with_name(profile_path.name.replace("decode_step", "host")))
    engine.abort_request("b1")
    engine.step()

    def generate_s(max_tokens: int) -> float:
        runs = []
        for _ in range(B1_REPS):
            start = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(**greedy, max_tokens=max_tokens), use_tqdm=False)
            runs.append(time.perf_counter() - start)
            if len(out[0].outputs[0].token_ids) != max_tokens:
                raise RuntimeError(f"asked {max_tokens} tokens, got {len(out[0].outputs[0].token_ids)}")
        return sorted(runs)[len(runs) // 2]

    one, full = generate_s(1), generate_s(gen_tokens)
    result.update(generate_1_token_s=round(one, 4), generate_n_tokens_s=round(full, 4), generated_tokens=gen_tokens,
                  tpot_ms=round(1e3 * (full - one) / (gen_tokens - 1), 4), target_tpot_ms=1.2, tokens_checked=True)
    return result


def full_batch(ckpt: str, profile_path: Path | None, smoke: bool = False, **engine_kwargs) -> dict:
    """The headline's batch, profiled: nano-vllm's 256 requests at temperature 0.6 with `LLM()`
    defaults, stepped until every request decodes, then the wall time of FULL_STEPS engine
    steps and torch.profiler over one more (where the time of a full decode step goes, to
    attribute the gap between the headline and its target), a cProfile of the host and, on a
    GPU, when the GPU idles and what the host does then (`profile_gpu_idle`).
    engine_kwargs: more `LLM` arguments (`tensor_parallel_size`: benchmarks/tensor_parallel.py)."""
    from minivllm import LLM, SamplingParams
    from minivllm.engine.profiler import TORCH_PROFILER_DIR_ENV
    from minivllm.sampling_params import RequestOutputKind

    prompts, max_tokens = make_workload(4 if smoke else 256)
    if smoke:
        prompts, max_tokens = [p[:16] for p in prompts], [40] * len(prompts)
    given = {"model": ckpt, "dtype": "float32" if smoke else "bfloat16",
             "max_model_len": 256 if smoke else NANO_MAX_MODEL_LEN, **engine_kwargs}
    every_rank = profile_path is not None and given.get("tensor_parallel_size", 1) > 1
    if every_rank:  # where LLMEngine.start_profile writes each rank's trace
        os.environ.setdefault(TORCH_PROFILER_DIR_ENV, tempfile.mkdtemp(prefix="minivllm-traces-"))
    llm = LLM(**given)
    engine = llm.llm_engine
    for i, (prompt, limit) in enumerate(zip(prompts, max_tokens)):  # as LLM.generate adds them
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=limit,
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    gc.collect()
    gc.freeze()  # as LLM.generate does while it steps: no full collection inside a timed step
    while engine.scheduler.waiting or any(g.is_prefill() for g in engine.scheduler.running):
        engine.step()
    engine.step()  # one decode-only step first (its shapes warm)
    seq = engine.scheduler.running[0].first_seq
    batch = len(engine.scheduler.running)
    times, tokens = [], 0
    for _ in range(2 if smoke else FULL_STEPS):
        before, start = seq.get_output_len(), time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        tokens += seq.get_output_len() - before
    result = {"engine_args": engine_args_used(given), "batch": batch,
              "num_scheduler_steps": engine.scheduler_config.num_scheduler_steps,
              "step_ms_median": round(1e3 * sorted(times)[len(times) // 2], 3),
              "ms_per_token_per_sequence": round(1e3 * sum(times) / max(1, tokens), 4),
              "output_tok_s_while_decoding": round(batch * tokens / sum(times), 1)}
    if profile_path is not None:
        result["profile"] = profile_one_step(engine, seq, profile_path, label=f"at batch {batch}")
        if every_rank:
            result["every_rank"] = profile_every_rank(engine, profile_path.with_name(profile_path.stem + "_ranks.json"))
        result["host_profile"] = profile_host(engine, 1 if smoke else HOST_PROFILE_STEPS,
                                              profile_path.with_name(profile_path.stem + "_host.txt"))
        if torch.cuda.is_available():
            result["gpu_idle"] = profile_gpu_idle(engine, IDLE_PROFILE_STEPS,
                                                  profile_path.with_name(profile_path.stem + "_gpu_idle.json"))
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    engine.step()
    gc.unfreeze()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--batch1", action="store_true",
                        help="batch-1 decode step, TPOT through LLM.generate and a one-step profile, "
                             "with LLM() defaults")
    parser.add_argument("--full-batch", action="store_true",
                        help="the headline's 256-request batch at temperature 0.6, LLM() defaults: "
                             "decode step time and a one-step profile")
    parser.add_argument("--smoke", action="store_true", help="with --batch1 / --full-batch: tiny, fp32 (CPU)")
    parser.add_argument("--cublas-linear", action="store_true",
                        help="with --batch1: every linear layer through cuBLAS, not the one-token Triton GEMV")
    parser.add_argument("--no-pdl", action="store_true",
                        help="with --batch1: no programmatic dependent launch between the kernels")
    args = parser.parse_args()
    if (args.cublas_linear or args.no_pdl) and not args.batch1:
        parser.error("--cublas-linear and --no-pdl go with --batch1")
    for wanted, measure_fn, profile_name in ((args.full_batch, full_batch, "profile_full_batch_decode_step.txt"),
                                             (args.batch1, batch1, "profile_batch1_decode_step.txt")):
        if wanted:
            extra = {**({"cublas_linear": True} if args.cublas_linear else {}), **({"pdl": False} if args.no_pdl else {})}
            variant = "_cublas" * args.cublas_linear + "_no_pdl" * args.no_pdl
            profile_name = profile_name.replace("batch1", "batch1" + variant)
            profile_path = Path(args.profile_dir) / profile_name if args.profile_dir else None
            report = measure_fn(args.ckpt, profile_path, smoke=args.smoke, **extra)
            Path(args.result).write_text(json.dumps(report, indent=1))
            print(json.dumps({k: v for k, v in report.items() if k != "profile"}), flush=True)
            return 0
    bandwidth = copy_bandwidth(args.device)
    report = {"copy_bandwidth_tb_s": round(bandwidth / 1e12, 3)}
    profile_dir = Path(args.profile_dir) if args.profile_dir else None
    for mode in args.modes:
        report[mode] = measure(args.ckpt, args.device, mode, bandwidth, profile_dir)
        Path(args.result).write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
