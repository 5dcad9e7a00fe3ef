"""Offline throughput: minivllm against what a user would otherwise reach for, on one GPU.

The workload is nano-vllm's offline benchmark (its bench.py): 256 requests, random prompt
token ids (0-10000) of 100-1024 tokens, 100-1024 new tokens each, EOS ignored, `random.seed(0)`
(prompts drawn first, then output lengths). Every system gets the same token ids and must
return exactly `max_tokens` tokens per request; the script checks it. Sampling is greedy
everywhere (nano-vllm samples at temperature 0.6; greedy lets us compare outputs, and costs
the same in every system).

Systems, each in its own process (so one's memory never limits the next):

    minivllm (16 / 8 steps)  LLM.generate with CUDA graphs and num_scheduler_steps=16 or 8:
                             each schedule() is followed by up to that many decode steps on
                             the GPU (multi-step scheduling); each step's tokens reach the
                             host while the next step runs
    minivllm (CUDA graphs)   LLM.generate, one decode step per schedule, replayed from graphs
    minivllm (eager)         the same with enforce_eager=True
    HF static batches        transformers `generate`, batches of --hf-batch-size requests in
                             request order (unsorted), left-padded; a batch runs until its
                             longest request is done, shorter ones are cut to their max_tokens
    HF continuous batching   transformers' ContinuousBatchingManager (init_continuous_batching),
                             per-request max_new_tokens

transformers takes about 4 minutes per system on the whole workload on an H100.
--hf-subset N gives it only the first N requests, for a quick look (tokens/s of that subset,
labelled "subset" in every table).

Models: local configs in benchmarks/configs (Qwen3-0.6B and Llama-3.2-1B shapes), random
weights (transformers `from_config`, seed 0), bf16, saved once to a temporary directory.

    python benchmarks/throughput.py all --out benchmarks/results/   # on a GPU: everything
    python benchmarks/throughput.py plot benchmarks/results/throughput_h100.json --png docs/img/throughput_h100.png
    python benchmarks/throughput.py kv-waste                         # KV-cache waste, no GPU needed

`all` writes throughput_<gpu>.json (every number), prints a markdown table, and draws the bar
chart beside it. nano-vllm's bench.py run exactly as bench.py runs it (temperature 0.6, its
warm-up, `LLM()` defaults) is benchmarks/nano_vllm_workload.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_SEQS,
                    PAD_TOKEN_ID, SEED, WARMUP_REQUESTS, WARMUP_TOKENS, build_checkpoint, checked_result,
                    environment, load_hf, make_workload, result_path, run_hf_cb, sync)

MODELS = ["qwen3-0.6b", "llama-3.2-1b"]
SYSTEMS = ["minivllm-ms16", "minivllm-ms8", "minivllm-graphs", "minivllm-eager", "hf-static", "hf-cb"]
SYSTEM_LABELS = {
    "minivllm-ms16": "minivllm (CUDA graphs, 16 steps per schedule)",
    "minivllm-ms8": "minivllm (CUDA graphs, 8 steps per schedule)",
    "minivllm-graphs": "minivllm (CUDA graphs)",
    "minivllm-eager": "minivllm (eager)",
    "hf-static": "transformers generate, static batches",
    "hf-cb": "transformers continuous batching",
}
MULTI_STEP = {"minivllm-ms16": 16, "minivllm-ms8": 8}  # num_scheduler_steps of the multi-step systems
HF_BATCH_SIZE, HF_SUBSET = 64, NUM_SEQS  # static batches of 64; the whole workload by default


# --------------------------------------------------------------------------- minivllm
class KVWasteLogger:
    """Engine stat logger: KV slots allocated vs holding a token, summed over sampled steps.

    allocated = blocks in use x block_size; used = tokens whose K/V are in the cache (the
    computed tokens of every running sequence). Sampled every `every` steps (cheap anyway).
    """

    def __init__(self, scheduler, num_gpu_blocks: int, block_size: int, every: int = 4) -> None:
        self.scheduler, self.num_gpu_blocks, self.block_size = scheduler, num_gpu_blocks, block_size
        self.every, self.steps = every, 0
        self.allocated = self.used = self.peak_allocated = self.preemptions = 0
        self.last_now, self.phase_s = None, {"prefill_s": 0.0, "decode_s": 0.0}

    def log(self, stats) -> None:
        self.steps += 1
        self.preemptions += stats.num_preemption_iter
        # Wall time per phase: from the previous step's end to this one's (a step with
        # prompt tokens is a prefill step; the default scheduler never mixes the two).
        if self.last_now is not None:
            phase = "prefill_s" if stats.num_prompt_tokens_iter else "decode_s"
            self.phase_s[phase] += stats.now - self.last_now
        self.last_now = stats.now
        if self.steps % self.every:
            return
        allocated = (self.num_gpu_blocks - self.scheduler.block_manager.get_num_free_gpu_blocks()) * self.block_size
        used = sum(seq.get_num_computed_tokens() for group in self.scheduler.running for seq in group.get_seqs()
                   if not seq.is_finished())
        self.allocated += allocated
        self.used += used
        self.peak_allocated = max(self.peak_allocated, allocated)

    def result(self) -> dict:
        waste = 1 - self.used / self.allocated if self.allocated else None
        return {"kv_waste_fraction": waste, "kv_peak_allocated_slots": self.peak_allocated,
                "kv_pool_slots": self.num_gpu_blocks * self.block_size, "preemptions": self.preemptions,
                "engine_steps": self.steps, **{k: round(v, 3) for k, v in self.phase_s.items()}}


def run_minivllm(ckpt: Path, prompts, max_tokens, enforce_eager: bool, device: str,
                 num_scheduler_steps: int = 1) -> dict:
    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(ckpt), dtype="bfloat16", device=device, enforce_eager=enforce_eager,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
              num_scheduler_steps=num_scheduler_steps)
    startup_s = time.perf_counter() - start
    engine = llm.llm_engine
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    # Warm-up on prompts of the workload's lengths: Triton compiles a kernel variant per
    # shape bucket on first use (once per machine, then from its cache), which is not what
    # the benchmark measures.
    llm.generate(inputs[:WARMUP_REQUESTS], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=WARMUP_TOKENS,
                                                          detokenize=False), use_tqdm=False)
    waste = KVWasteLogger(engine.scheduler, engine.cache_config.num_gpu_blocks, engine.cache_config.block_size)
    engine.add_logger("kv_waste", waste)
    sync(device)
    start = time.perf_counter()
    waste.last_now = time.monotonic()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result = checked_result(token_ids, max_tokens, elapsed)
    result.update(waste.result(), startup_s=round(startup_s, 2), num_gpu_blocks=engine.cache_config.num_gpu_blocks,
                  block_size=engine.cache_config.block_size)
    result["first_outputs"] = [t[:16] for t in token_ids[:8]]
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def simulate_kv_waste(num_seqs: int = NUM_SEQS, num_gpu_blocks: int = 40_000, block_size: int = 16) -> dict:
    """KV waste of the workload, from the real Scheduler + BlockSpaceManager, no GPU needed.

    `minivllm.viz.sim` drives the engine with a stand-in model that emits exactly
    each request's max_tokens; after every step we count, as `KVWasteLogger` does in the
    GPU runs, slots allocated (blocks in use x block_size) against slots holding a computed
    token. Block allocation does not depend on the model's numbers, so this is the figure
    the engine has on any device. The pool (40,000 blocks) is large enough that nothing is
    preempted, as on an 80 GB GPU. Also reported: what reserving max_model_len slots per
    running request up front (the pre-paging way) would waste.
    """
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator

    prompts, max_tokens = make_workload(num_seqs)
    requests = [SimRequest(str(i), p, [m], max_tokens=m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    totals = {"allocated": 0, "used": 0, "reserved": 0, "peak_allocated": 0, "steps": 0}

    class _Measured(Simulator):
        def step(self):
            snapshot = super().step()
            bm = self.scheduler.block_manager
            allocated = (num_gpu_blocks - bm.get_num_free_gpu_blocks()) * block_size
            seqs = [seq for group in self.scheduler.running for seq in group.get_seqs() if not seq.is_finished()]
            totals["allocated"] += allocated
            totals["used"] += sum(seq.get_num_computed_tokens() for seq in seqs)
            totals["reserved"] += MAX_MODEL_LEN * len(seqs)
            totals["peak_allocated"] = max(totals["peak_allocated"], allocated)
            totals["steps"] += 1
            return snapshot

    scheduler_config = SchedulerConfig(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                                       max_model_len=MAX_MODEL_LEN)
    cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0)
    result = _Measured(scheduler_config, cache_config).run(requests)
    preemptions = sum(r.num_preemptions for r in result.results.values())
    return {"kv_waste_fraction": round(1 - totals["used"] / totals["allocated"], 4),
            "reservation_waste_fraction": round(1 - totals["used"] / totals["reserved"], 4),
            "peak_allocated_slots": totals["peak_allocated"], "steps": totals["steps"], "preemptions": preemptions,
            "block_size": block_size, "num_gpu_blocks": num_gpu_blocks}


# --------------------------------------------------------------------------- transformers
def run_hf_static(ckpt: Path, prompts, max_tokens, device: str, batch_size: int) -> dict:
    model = load_hf(ckpt, device)
    _hf_static_batch(model, prompts[:2], [WARMUP_TOKENS] * 2, device)  # warm-up
    sync(device)
    start = time.perf_counter()
    token_ids, padded_tokens = [], 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch_ids, batch_len = _hf_static_batch(model, prompts[i : i + batch_size], max_tokens[i : i + batch_size], device)
            token_ids += batch_ids
            padded_tokens += batch_len * len(batch_ids)
    sync(device)
    elapsed = time.perf_counter() - start
    result = checked_result(token_ids, max_tokens, elapsed)
    result.update(batch_size=batch_size, order="request order (unsorted)", generated_incl_padding=padded_tokens)
    result["first_outputs"] = [t[:16] for t in token_ids[:8]]
    return result


def _hf_static_batch(model, prompts, max_tokens, device: str):
    """One left-padded batch, run to its longest request; each output cut to its max_tokens."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the same column
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    new_tokens = max(max_tokens)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=new_tokens, min_new_tokens=None, do_sample=False)
    generated = out[:, width:].tolist()
    if any(len(g) != new_tokens for g in generated):
        raise RuntimeError("transformers stopped a static batch early.")
    return [g[:m] for g, m in zip(generated, max_tokens)], new_tokens



def run_one(args: argparse.Namespace) -> int:
    """One system on one model, in this process; writes a JSON file."""
    prompts, max_tokens = make_workload(args.num_seqs)
    subset = args.num_seqs if args.system.startswith("minivllm") else min(args.hf_subset, args.num_seqs)
    prompts, max_tokens = prompts[:subset], max_tokens[:subset]
    ckpt = Path(args.ckpt)
    if args.system in MULTI_STEP:
        result = run_minivllm(ckpt, prompts, max_tokens, enforce_eager=False, device=args.device,
                              num_scheduler_steps=MULTI_STEP[args.system])
    elif args.system == "minivllm-graphs":
        result = run_minivllm(ckpt, prompts, max_tokens, enforce_eager=False, device=args.device)
    elif args.system == "minivllm-eager":
        result = run_minivllm(ckpt, prompts, max_tokens, enforce_eager=True, device=args.device)
    elif args.system == "hf-static":
        result = run_hf_static(ckpt, prompts, max_tokens, args.device, args.hf_batch_size)
    else:
        result = run_hf_cb(ckpt, prompts, max_tokens, args.device)
    result.update(system=args.system, subset=subset < args.num_seqs)
    Path(args.result).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "first_outputs"}), flush=True)
    return 0


# --------------------------------------------------------------------------- orchestration
def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    report = {"environment": env, "workload": _workload_summary(args.num_seqs),
              "settings": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
                           "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                           "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "hf_subset": args.hf_subset,
                           "hf_batch_size": args.hf_batch_size, "sampling": "greedy, ignore_eos"},
              "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="minivllm-bench-"))
    for model in args.models:
        ckpt = build_checkpoint(model, tmp, args.device, json.loads(args.config_overrides or "{}"))
        report["models"][model] = results = _reused_rows(args, model)
        if args.decode_latency and model in (args.decode_latency_models or args.models):  # first: it also writes the profiles, the most useful output
            results["decode_latency"] = _run_decode_latency(args, ckpt, tmp)
            _save(out, report)
        for system in args.systems:
            results[system] = _run_subprocess(args, model, system, ckpt, tmp)
            _save(out, report)
        results["agreement"] = output_agreement(results)
        _save(out, report)
    print(markdown_table(report))
    plot(report, result_path("throughput", env, out, ".png"))
    return 0


def _reused_rows(args, model: str) -> dict:
    """Rows of systems not run now, taken from an earlier throughput.json (--reuse), marked."""
    if not args.reuse:
        return {}
    earlier = json.loads(Path(args.reuse).read_text())["models"].get(model, {})
    return {system: dict(row, reused_from=args.reuse) for system, row in earlier.items()
            if system in SYSTEMS and system not in args.systems and "error" not in row}


def output_agreement(results: dict) -> dict:
    """For each system: how many of the first 8 requests have the same first 16 greedy tokens
    as minivllm (CUDA graphs). bf16 kernels differ in rounding, so near-ties can flip a token;
    exact greedy parity is tested in fp32 on the CPU (tests/engine)."""
    reference = results.get("minivllm-graphs", {}).get("first_outputs")
    agreement = {}
    for system, r in results.items():
        if reference and r.get("first_outputs") and system != "minivllm-graphs":
            pairs = list(zip(reference, r["first_outputs"]))
            agreement[system] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return agreement


def _run_subprocess(args, model: str, system: str, ckpt: Path, tmp: Path) -> dict:
    result_file = tmp / f"{model}-{system}.json"
    cmd = [sys.executable, __file__, "one", "--system", system, "--ckpt", str(ckpt), "--result", str(result_file),
           "--num-seqs", str(args.num_seqs), "--hf-subset", str(args.hf_subset),
           "--hf-batch-size", str(args.hf_batch_size), "--device", args.device]
    print(f"== {model} / {system}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=args.system_timeout)
        failed = proc.returncode != 0
    except subprocess.TimeoutExpired:
        failed = True
    wall = round(time.perf_counter() - start, 1)
    if failed or not result_file.exists():
        return {"system": system, "error": f"failed or timed out after {wall} s", "wall_s": wall}
    result = json.loads(result_file.read_text())
    result["wall_s"] = wall
    return result


def _run_decode_latency(args, ckpt: Path, tmp: Path) -> dict:
    result_file = tmp / f"{ckpt.name}-decode.json"
    cmd = [sys.executable, str(Path(__file__).parent / "decode_latency.py"), "--ckpt", str(ckpt),
           "--result", str(result_file), "--device", args.device]
    if args.decode_latency_modes:
        cmd += ["--modes", *args.decode_latency_modes]
    if args.profile_dir:
        cmd += ["--profile-dir", str(Path(args.profile_dir) / ckpt.name)]
    print(f"== {ckpt.name} / decode latency", flush=True)
    try:
        subprocess.run(cmd, timeout=args.system_timeout)
    except subprocess.TimeoutExpired:
        pass
    return json.loads(result_file.read_text()) if result_file.exists() else {"error": "failed or timed out"}


def _save(out: Path, report: dict) -> None:
    result_path("throughput", report["environment"], out).write_text(json.dumps(report, indent=1))


def _workload_summary(num_seqs: int) -> dict:
    prompts, max_tokens = make_workload(num_seqs)
    return {"source": "nano-vllm bench.py", "num_seqs": num_seqs, "seed": SEED,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(max_tokens)}


# --------------------------------------------------------------------------- reporting
def markdown_table(report: dict) -> str:
    lines = ["| model | system | requests | output tokens | time (s) | output tok/s | vs HF static | vs HF CB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, results in report["models"].items():
        rate = {s: r.get("output_tokens_per_s") for s, r in results.items() if s in SYSTEMS}
        for system in SYSTEMS:
            r = results.get(system)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {model} | {SYSTEM_LABELS[system]} | – | – | – | {r['error']} | | |")
                continue
            label = SYSTEM_LABELS[system] + (" (subset)" if r.get("subset") else "")
            label += " (earlier run)" if r.get("reused_from") else ""
            ratios = [_ratio(rate[system], rate.get(peer)) for peer in ("hf-static", "hf-cb")]
            lines.append(f"| {model} | {label} | {r['num_requests']} | {r['output_tokens']} | {r['elapsed_s']} | "
                         f"{r['output_tokens_per_s']:,.0f} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


def _ratio(a, b) -> str:
    return f"{a / b:.1f}x" if a and b else "–"


def plot(report: dict, png: Path) -> None:
    """Grouped bars: output tokens/s per system, one group per model (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.viz.style import COLORS

    models = list(report["models"])
    # minivllm in the blues of "our" blocks, transformers in the warm colours.
    colors = {"minivllm-ms16": COLORS["finished"], "minivllm-ms8": COLORS["shared"], "minivllm-graphs": COLORS["used"],
              "minivllm-eager": COLORS["generated"],
              "hf-static": COLORS["copied"], "hf-cb": COLORS["prompt"]}
    fig, ax = plt.subplots(figsize=(9, 5.4))
    width = 0.8 / len(SYSTEMS)
    for j, system in enumerate(SYSTEMS):
        values = [report["models"][m].get(system, {}).get("output_tokens_per_s") or 0 for m in models]
        xs = [i + (j - (len(SYSTEMS) - 1) / 2) * width for i in range(len(models))]
        bars = ax.bar(xs, values, width, label=SYSTEM_LABELS[system], color=colors[system])
        for bar, value in zip(bars, values):
            if value:
                ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                            va="bottom", fontsize=8)
    ax.set_xticks(range(len(models)), [f"{m} shape\n(transformers: {_hf_requests(report['models'][m])})"
                                       for m in models])
    ax.set_yscale("log")
    ax.set_ylabel("output tokens / s (log scale)")
    gpu = report["environment"].get("gpu", "CPU")
    ax.set_title(f"Offline throughput, nano-vllm workload, bf16, {gpu}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _hf_requests(results: dict) -> str:
    row = results.get("hf-static") or results.get("hf-cb") or {}
    return f"first {row['num_requests']} requests" if row.get("subset") else "all requests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    common.add_argument("--hf-subset", type=int, default=HF_SUBSET, help="requests given to transformers")
    common.add_argument("--hf-batch-size", type=int, default=HF_BATCH_SIZE)
    common.add_argument("--device", default="cuda")
    everything = sub.add_parser("all", parents=[common], help="every system on every model")
    everything.add_argument("--out", required=True)
    everything.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    everything.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    everything.add_argument("--decode-latency", action="store_true", help="also run decode_latency.py")
    everything.add_argument("--decode-latency-models", nargs="+", default=None, choices=MODELS,
                            help="models for --decode-latency (default: all)")
    everything.add_argument("--decode-latency-modes", nargs="+", default=None,
                            help="modes for decode_latency.py (default: all of its modes)")
    everything.add_argument("--profile-dir", default=None, help="decode_latency.py writes profiles here")
    everything.add_argument("--reuse", default=None,
                            help="earlier throughput.json: rows of systems not run now are copied (marked)")
    everything.add_argument("--system-timeout", type=float, default=600)
    everything.add_argument("--config-overrides", default=None, help='JSON, e.g. {"num_hidden_layers": 2}')
    everything.set_defaults(func=run_all)
    one = sub.add_parser("one", parents=[common], help="one system (used by `all`)")
    one.add_argument("--system", required=True, choices=SYSTEMS)
    one.add_argument("--ckpt", required=True)
    one.add_argument("--result", required=True)
    one.set_defaults(func=run_one)
    waste = sub.add_parser("kv-waste", help="KV-cache waste of the workload (real block manager, no GPU)")
    waste.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    waste.set_defaults(func=lambda a: print(json.dumps(simulate_kv_waste(a.num_seqs))) or 0)
    redraw = sub.add_parser("plot", help="table and chart from a saved throughput.json")
    redraw.add_argument("json")
    redraw.add_argument("--png", required=True)
    redraw.set_defaults(func=lambda a: _redraw(a.json, a.png))
    args = parser.parse_args(argv)
    return args.func(args)


def _redraw(json_path: str, png: str) -> int:
    report = json.loads(Path(json_path).read_text())
    print(markdown_table(report))
    plot(report, Path(png))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
