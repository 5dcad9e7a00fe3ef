"""nano-vllm's bench.py workload as bench.py runs it, and labelled variations: one command, each row its own process.

    python benchmarks/nano_vllm_workload.py run --out DIR             # on one GPU, about 8.5 minutes
    python benchmarks/nano_vllm_workload.py run --out DIR --only headline hf-cb
    python benchmarks/nano_vllm_workload.py run --out /tmp/s --smoke  # tiny model on the CPU, seconds

The headline is nano-vllm's offline benchmark exactly as its bench.py runs it (256 requests,
random prompt ids of 100-1024 tokens, 100-1024 new tokens, temperature 0.6, ignore_eos, its
one-line warm-up, `LLM(model, dtype, max_model_len=4096)` and nothing else), on a Qwen3-0.6B
shape with random bf16 weights, beside transformers' continuous batching on the same requests.
Every other row is labelled by what it changes. The rows, in the order they run (the ones
that matter most first, so a run cut short still has them):

    headline        minivllm, LLM() defaults, temperature 0.6
    hf-cb           transformers continuous batching, temperature 0.6 (the first HF_CB_REQUESTS requests)
    greedy          defaults, temperature 0
    top-p-k         defaults, temperature 0.6, top_p 0.95, top_k 50
    penalties       defaults, temperature 0.6, repetition 1.1, frequency 0.5, presence 0.5
    full-batch      the headline's 256 requests once all decode: step time and profiles (decode_latency.py)
    prefill-attn    paged prefill Triton kernel vs SDPA flash, 1x8192 and 16x1024 (kernels.py --prefill)
    batch1          decode step and TPOT at batch 1, one-step profile (decode_latency.py --batch1)
    batch1-cublas   the same with every linear layer through cuBLAS, not the one-token Triton GEMV
    batch1-no-pdl   the same without programmatic dependent launch between kernels
    serving         256 streaming clients through the OpenAI server (serving.py --workload)
    serving-async   the same with --async-scheduling
    serving-inproc  the same with the engine inside the server's process
    serving-1client the same with every client in one process
    llama-1b        Llama-3.2-1B shape, defaults, temperature 0.6
    ms16            tuned: num_scheduler_steps=16, temperature 0.6
    no-async        the headline with async_scheduling=False
    headline-idle   diagnostic: the headline, GPU idle profiled at engine steps 45-47 (no-async-idle: without
                    async scheduling)
    eager           enforce_eager=True, temperature 0.6

Before a model's first minivllm row, one untimed process ("prime") runs the engine on a slice
of the workload with each of that model's sampling modes, so Triton's on-disk cache holds the
kernels (a user's second run of bench.py on a machine sees the same). Each row has a timeout;
no row starts once the budget is spent, and a row never runs past it. Results go to OUT/nano_vllm_workload_<gpu>.json after every row
(the name of the latest result in benchmarks/results/), the markdown table to the same name with
.md, subprocess logs to OUT/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import (NANO_MAX_MODEL_LEN, NANO_WARMUP_PARAMS, NANO_WARMUP_PROMPT, GpuIdleProfile, ProgressLogger,
                    StepTimeline, build_checkpoint, running_context_tokens, checked_result, engine_args_used, environment,
                    gpu_clocks, kernel_name, make_workload, resolved_engine_settings, result_path, row_workload, run_hf_cb,
                    sync, triton_cache_entries)
from startup import TritonBuildTimer, summarize as summarize_builds

HERE = Path(__file__).parent
BUDGET_S = 480.0  # the whole run, checkpoints included: fits a 9-minute device call with margin
MIN_ROW_S = 25.0  # a row given less than this is skipped, not started to be killed
PRIME_TIMEOUT_S, PRIME_REQUESTS, PRIME_TOKENS = 60, 64, 24
HF_CB_REQUESTS = 32  # transformers does ~600 tok/s: the whole workload would take 4 minutes
TEMPERATURE = {"temperature": 0.6}
SMOKE_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 10240, "bos_token_id": 1,
                "eos_token_id": 2}
SMOKE_WORKLOAD = {"num_seqs": 4, "prompt_cap": 48, "max_tokens_cap": 8, "dtype": "float32"}


@dataclass
class Row:
    """One measurement: `kind` says which script runs it, `spec` what it changes."""

    name: str
    label: str
    kind: str  # "throughput", "prefill", "batch1", "full-batch", "serving"
    timeout_s: float
    model: str = "qwen3-0.6b"
    spec: dict = field(default_factory=dict)


SERVING_CLIENT_PROCESSES = 4

ROWS = [
    Row("headline", "minivllm, LLM() defaults, temperature 0.6 (nano-vllm bench.py)", "throughput", 90,
        spec={"sampling": TEMPERATURE}),
    Row("hf-cb", "transformers continuous batching, temperature 0.6 (only the first requests: see the count)",
        "throughput", 180, spec={"system": "hf-cb", "sampling": TEMPERATURE, "num_seqs": HF_CB_REQUESTS}),
    Row("greedy", "minivllm, LLM() defaults, greedy (temperature 0)", "throughput", 80,
        spec={"sampling": {"temperature": 0.0}}),
    Row("top-p-k", "minivllm, defaults, temperature 0.6 + top_p 0.95 + top_k 50", "throughput", 80,
        spec={"sampling": {**TEMPERATURE, "top_p": 0.95, "top_k": 50}}),
    Row("penalties", "minivllm, defaults, temperature 0.6 + repetition 1.1 / frequency 0.5 / presence 0.5",
        "throughput", 80, spec={"sampling": {**TEMPERATURE, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                                             "presence_penalty": 0.5}}),
    Row("full-batch", "the headline's 256 requests decoding (temperature 0.6, defaults): step time and a profile",
        "full-batch", 75),
    Row("prefill-attn", "paged prefill attention (Triton) vs SDPA flash, contiguous K/V", "prefill", 60),
    Row("batch1", "batch 1: decode step and TPOT through LLM.generate, LLM() defaults", "batch1", 75),
    Row("batch1-cublas", "extra: the batch1 row with every linear layer through cuBLAS (the Triton GEMV's peer)",
        "batch1", 75, spec={"cublas_linear": True}),
    Row("batch1-no-pdl", "extra: the batch1 row without programmatic dependent launch", "batch1", 75,
        spec={"no_pdl": True}),
    # The clients run in 4 processes: one Python process reading ~10k chunks/s is the bottleneck.
    Row("serving", "OpenAI server, every request a concurrent streaming client, defaults, temperature 0.6",
        "serving", 130, spec={"client_processes": SERVING_CLIENT_PROCESSES}),
    Row("serving-async", "extra: the serving row with async scheduling on (--async-scheduling; the server's "
        "default leaves it off)", "serving", 130,
        spec={"server_args": ["--async-scheduling"], "client_processes": SERVING_CLIENT_PROCESSES}),
    Row("serving-inproc", "extra: the same, the engine inside the server's process (--disable-frontend-multiprocessing)",
        "serving", 130, spec={"server_args": ["--disable-frontend-multiprocessing"],
                              "client_processes": SERVING_CLIENT_PROCESSES}),
    Row("serving-1client", "extra: the serving row with every client in one process (the harness saturates)",
        "serving", 130),
    Row("llama-1b", "minivllm, LLM() defaults, temperature 0.6, Llama-3.2-1B shape", "throughput", 90,
        model="llama-3.2-1b", spec={"sampling": TEMPERATURE}),
    Row("ms16", "minivllm, tuned: num_scheduler_steps=16, temperature 0.6", "throughput", 80,
        spec={"sampling": TEMPERATURE, "engine_args": {"num_scheduler_steps": 16}}),
    Row("no-async", "extra: the headline with async_scheduling=False (each run scheduled after the last)",
        "throughput", 90, spec={"sampling": TEMPERATURE, "engine_args": {"async_scheduling": False}}),
    # Diagnostics: the GPU-idle profile (decode_latency.GpuIdleProfile) over engine steps
    # 45-47 of the run (the full batch decoding); the profiler slows those steps.
    Row("headline-idle", "diagnostic: the headline, GPU idle profiled at steps 45-47", "throughput", 100,
        spec={"sampling": TEMPERATURE, "idle_profile_at": 45}),
    Row("no-async-idle", "diagnostic: no-async, GPU idle profiled at steps 45-47", "throughput", 100,
        spec={"sampling": TEMPERATURE, "engine_args": {"async_scheduling": False}, "idle_profile_at": 45}),
    Row("eager", "minivllm, enforce_eager=True, temperature 0.6", "throughput", 100,
        spec={"sampling": TEMPERATURE, "engine_args": {"enforce_eager": True}}),
]
ROW_NAMES = [row.name for row in ROWS]
TARGETS = {"headline": 16_000, "greedy": 20_000, "llama-1b": 24_000}  # the project's output tok/s targets, one H100


# --------------------------------------------------------------------------- running
class Runner:
    """Runs commands one at a time under the budget, logging each to OUT/logs/<name>.log."""

    def __init__(self, out: Path, budget_s: float, min_row_s: float = MIN_ROW_S) -> None:
        self.out, self.budget_s, self.min_row_s, self.start = out, budget_s, min_row_s, time.perf_counter()
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def remaining(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def run(self, name: str, cmd: list[str], timeout_s: float, env: dict | None = None) -> dict:
        """{"wall_s", "returncode"} or {"error": ...}; never raises for a failed or slow child."""
        timeout = min(timeout_s, self.remaining())
        if timeout < self.min_row_s:
            return {"error": f"skipped: {self.remaining():.0f} s of the {self.budget_s:.0f} s budget left"}
        print(f"== {name} (timeout {timeout:.0f} s): {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        with open(self.out / "logs" / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                    start_new_session=True)  # its own group: a timeout ends its children too
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                return {"error": f"timed out after {timeout:.0f} s", "wall_s": round(time.perf_counter() - start, 1)}
        wall = round(time.perf_counter() - start, 1)
        if returncode:
            tail = (self.out / "logs" / f"{name}.log").read_text()[-600:]
            return {"error": f"exit status {returncode}", "wall_s": wall, "log_tail": tail}
        return {"wall_s": wall, "returncode": 0}


def row_command(row: Row, ckpt: Path, result: Path, out: Path, smoke: bool) -> list[str]:
    py = sys.executable
    if row.kind == "throughput":
        spec = {**row.spec, **(SMOKE_WORKLOAD if smoke else {})}
        if smoke and row.spec.get("num_seqs"):
            spec["num_seqs"] = min(row.spec["num_seqs"], SMOKE_WORKLOAD["num_seqs"])
        return [py, __file__, "row", "--spec", json.dumps(spec), "--ckpt", str(ckpt),
                "--result", str(result), "--device", "cpu" if smoke else "cuda"]
    if row.kind == "prefill":
        return [py, str(HERE / "kernels.py"), "--prefill", "--out", str(result.parent / "prefill")] + \
            (["--smoke"] if smoke else [])
    if row.kind == "batch1":
        return [py, str(HERE / "decode_latency.py"), "--batch1", "--ckpt", str(ckpt), "--result", str(result),
                "--profile-dir", str(out)] + (["--smoke"] if smoke else []) + \
            (["--cublas-linear"] if row.spec.get("cublas_linear") else []) + (["--no-pdl"] if row.spec.get("no_pdl") else [])
    if row.kind == "full-batch":
        return [py, str(HERE / "decode_latency.py"), "--full-batch", "--ckpt", str(ckpt), "--result", str(result),
                "--profile-dir", str(out)] + (["--smoke"] if smoke else [])
    if row.kind == "serving":
        return [py, str(HERE / "serving.py"), "--workload", "--ckpt", str(ckpt), "--json", str(result),
                "--server-log", str(out / "logs" / f"{row.name}.server.log")] + \
            [f"--server-arg={a}" for a in row.spec.get("server_args", [])] + \
            ["--client-processes", str(row.spec.get("client_processes", 1))] + (["--smoke"] if smoke else [])
    raise ValueError(f"unknown row kind {row.kind!r}")


def read_result(row: Row, result: Path) -> dict:
    if row.kind == "prefill":  # kernels.py --prefill names its file for the machine
        result = next(iter(sorted((result.parent / "prefill").glob("prefill_attention_*.json"))), result)
    return json.loads(result.read_text()) if result.exists() else {"error": "no result file"}


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (300.0 if args.smoke else BUDGET_S)
    runner = Runner(out, budget)
    unknown = set(args.only or []) - set(ROW_NAMES)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {ROW_NAMES}")
    rows = [row for row in ROWS if not args.only or row.name in args.only]
    tmp = Path(tempfile.mkdtemp(prefix="minivllm-workload-"))
    report = {"command": " ".join(sys.argv), "smoke": args.smoke, "budget_s": budget, "rows": {},
              "labels": {row.name: row.label for row in rows}, "targets_tok_s": TARGETS}

    models = sorted({row.model for row in rows if row.kind != "prefill"}, key=["qwen3-0.6b", "llama-3.2-1b"].index)
    build = [sys.executable, __file__, "build", "--dir", str(tmp), "--models", *models] + (["--smoke"] if args.smoke else [])
    report["build"] = runner.run("build", build, 120) if models else {}
    report["environment"] = json.loads((tmp / "environment.json").read_text()) if (tmp / "environment.json").exists() else {}
    result_json = result_path("nano_vllm_workload", report["environment"], out)
    save = lambda: result_json.write_text(json.dumps(report, indent=1))  # noqa: E731
    save()
    report["prime"] = {}
    for row in rows:
        minivllm_row = row.kind == "throughput" and "system" not in row.spec
        if minivllm_row and row.model not in report["prime"] and not args.smoke:  # before its first minivllm row
            prime_cmd = [sys.executable, __file__, "prime", "--ckpt", str(tmp / row.model)]
            report["prime"][row.model] = runner.run(f"prime-{row.model}", prime_cmd, PRIME_TIMEOUT_S)
            save()
        result = tmp / f"{row.name}.json"
        cached_before = set(triton_cache_entries())
        status = runner.run(row.name, row_command(row, tmp / row.model, result, out, args.smoke), row.timeout_s)
        # A row that failed keeps whatever it wrote (serving writes its numbers, then fails on a wrong count).
        report["rows"][row.name] = {**read_result(row, result), **status}
        if "error" in status and report["rows"][row.name].get("error") != status["error"]:
            report["rows"][row.name]["error"] = status["error"]
        progress = result.with_suffix(".progress.json")
        if "error" in status and progress.exists():  # how far a row that did not finish got
            report["rows"][row.name]["partial"] = json.loads(progress.read_text())
        if minivllm_row and not args.smoke:  # a cold Triton cache puts compile time into the timed run
            report["rows"][row.name]["triton_cache_primed"] = "error" not in report["prime"].get(row.model, {})
        # Kernels this row compiled (not found in the cache): each is ~1 s of its time.
        compiled = sorted(set(triton_cache_entries()) - cached_before)
        report["rows"][row.name]["triton_kernels_compiled"] = len(compiled)
        report["rows"][row.name]["triton_kernels_compiled_names"] = [kernel_name(entry) for entry in compiled]
        save()
    report["total_s"] = round(time.perf_counter() - runner.start, 1)
    save()
    shutil.rmtree(tmp, ignore_errors=True)  # the checkpoints (GBs); every number is in the JSON
    table = markdown_table(report)
    result_json.with_suffix(".md").write_text(table + "\n")
    print(table)
    # Skipped for the budget is not a failure; a row that broke or ran out of its own time is.
    return int(any(not r["error"].startswith("skipped") for r in report["rows"].values() if "error" in r))


# --------------------------------------------------------------------------- the steps before the rows
def build(args: argparse.Namespace) -> int:
    """Random-weight checkpoints of the models, and the environment, into --dir."""
    device = "cpu" if args.smoke else "cuda"
    directory = Path(args.dir)
    for model in args.models:
        build_checkpoint(model, directory, device, SMOKE_CONFIG if args.smoke else None)
    (directory / "environment.json").write_text(json.dumps(environment(device)))
    return 0


def prime(args: argparse.Namespace) -> int:
    """Untimed: every sampling mode of the model's rows once, on workload-length prompts, so
    Triton's cache holds the kernels before the first timed row (a first run on a machine compiles)."""
    from minivllm import LLM, SamplingParams

    prompts, _ = make_workload()
    llm = LLM(model=args.ckpt, dtype="bfloat16", max_model_len=NANO_MAX_MODEL_LEN)
    inputs = [{"prompt_token_ids": p} for p in prompts[:PRIME_REQUESTS]]
    modes = {json.dumps(row.spec["sampling"], sort_keys=True) for row in ROWS if row.kind == "throughput"
             and row.model == Path(args.ckpt).name and "system" not in row.spec}
    for sampling in sorted(modes):
        llm.generate(inputs, SamplingParams(**json.loads(sampling), ignore_eos=True, max_tokens=PRIME_TOKENS),
                     use_tqdm=False)
    return 0


# --------------------------------------------------------------------------- one throughput row
def run_minivllm_row(spec: dict, ckpt: Path, progress: Path | None = None) -> dict:
    """One throughput row as nano-vllm's bench.py runs it: its engine arguments (model, dtype,
    max_model_len, plus the row's explicit extras), its one-line warm-up, one timed generate."""
    from minivllm import LLM, SamplingParams

    builds = TritonBuildTimer()  # every kernel build of this process, timed: a stall names its kernel
    prompts, max_tokens = row_workload(spec)
    given = {"model": str(ckpt), "dtype": spec.get("dtype", "bfloat16"), "max_model_len": NANO_MAX_MODEL_LEN,
             **spec.get("engine_args", {})}
    start = time.perf_counter()
    llm = LLM(**given)
    startup_s = time.perf_counter() - start
    sampling = dict(spec.get("sampling", {}), ignore_eos=True)
    params = [SamplingParams(**sampling, max_tokens=m) for m in max_tokens]
    llm.generate([NANO_WARMUP_PROMPT], SamplingParams(**NANO_WARMUP_PARAMS), use_tqdm=False)
    device = str(llm.llm_engine.device_config.device)
    sync(device)
    if progress is not None:
        llm.llm_engine.add_logger("progress", ProgressLogger(progress))
    timeline = StepTimeline(context_tokens=lambda: running_context_tokens(llm.llm_engine),
                            builds=builds.builds if builds.installed else None)
    built_before_run = len(builds.builds)
    llm.llm_engine.add_logger("timeline", timeline)
    idle = None
    if spec.get("idle_profile_at"):  # a diagnostic row: the profiler slows the steps it watches
        idle = GpuIdleProfile(llm.llm_engine, at_step=spec["idle_profile_at"])
        llm.llm_engine.add_logger("gpu_idle", idle)
    with gpu_clocks(device) as clocks:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync(device)
        elapsed = time.perf_counter() - start
    result = checked_result([list(o.outputs[0].token_ids) for o in outputs], max_tokens, elapsed)
    result["gpu_clocks"] = clocks
    result["timeline"] = timeline.summary()
    result["stalls"] = timeline.stalls
    result["triton_builds_in_run"] = summarize_builds(builds.builds[built_before_run:]) if builds.installed else None
    if idle is not None:
        result["gpu_idle"] = idle.summary
    result.update(engine_args=engine_args_used(given), engine_resolved=resolved_engine_settings(llm.llm_engine),
                  sampling_params=sampling, sampling_params_repr=repr(params[0]),
                  warmup=f"generate([{NANO_WARMUP_PROMPT!r}], SamplingParams({NANO_WARMUP_PARAMS}))",
                  startup_s=round(startup_s, 2), prompt_tokens=sum(map(len, prompts)))
    return result


def run_hf_cb_row(spec: dict, ckpt: Path, device: str, progress: Path | None = None) -> dict:
    """transformers' continuous batching on the row's workload, sampling as the row says
    (top_k 0 / top_p 1: only the temperature, as nano-vllm samples)."""
    prompts, max_tokens = row_workload(spec)
    sampling = spec.get("sampling", {})
    temperature = sampling.get("temperature", 1.0)
    result = run_hf_cb(ckpt, prompts, max_tokens, device, temperature=temperature, progress=progress)
    result.update(sampling_params={"temperature": temperature, "top_k": 0, "top_p": 1.0, "ignore_eos": True},
                  engine_args={"attn_implementation": result.get("attn_implementation"), "dtype": "bfloat16"})
    return result


def run_row(args: argparse.Namespace) -> int:
    """`row`: one throughput row in this process; writes its JSON to --result."""
    spec = json.loads(args.spec)
    ckpt = Path(args.ckpt)
    progress = Path(args.result).with_suffix(".progress.json")
    if spec.get("system", "minivllm") == "hf-cb":
        result = run_hf_cb_row(spec, ckpt, args.device, progress)
    else:
        result = run_minivllm_row(spec, ckpt, progress)
    result.update(spec=spec)
    Path(args.result).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("engine_args", "first_outputs")}), flush=True)
    return 0

# --------------------------------------------------------------------------- reporting
def markdown_table(report: dict) -> str:
    rows, labels = report["rows"], report["labels"]
    headline = rows.get("headline", {}).get("output_tokens_per_s")
    lines = ["| row | requests | output tokens | time (s) | output tok/s | vs headline | target | checked |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        if "error" in r or "output_tokens_per_s" not in r:
            continue
        ratio = f"{r['output_tokens_per_s'] / headline:.2f}x" if headline and name != "headline" else ""
        cold = " (Triton cache cold: compile time included)" if r.get("triton_cache_primed") is False else ""
        target = f">= {TARGETS[name]:,}" if name in TARGETS else ""
        lines.append(f"| {labels[name]}{cold} | {r.get('num_requests', r.get('num_clients'))} | {r['output_tokens']:,} | "
                     f"{r['elapsed_s']} | {r['output_tokens_per_s']:,.0f} | {ratio} | {target} | "
                     f"{r.get('tokens_checked')} |")
    lines += _extra_lines(rows, headline)
    failed = [f"- {labels[n]}: {r['error']}{_partial(r)}" for n, r in rows.items() if "error" in r]
    return "\n".join(lines + (["", "Not measured:"] + failed if failed else []))


def _partial(row: dict) -> str:
    p = row.get("partial")
    if not p or not p["seconds_so_far"]:
        return ""
    which = "tokens of the requests that finished" if p.get("finished_requests_only") else "tokens"
    return (f" (unfinished: {p['output_tokens_so_far']:,} {which} in {p['seconds_so_far']} s of the timed run, "
            f"{p['output_tokens_so_far'] / p['seconds_so_far']:,.0f} tok/s so far)")


def _extra_lines(rows: dict, base: float | None) -> list[str]:
    """The rows that are not a tokens/s line: costs against the headline (`base`), latency, kernels."""
    lines = []
    for name, limit in (("top-p-k", 0.05), ("penalties", 0.10)):
        rate = rows.get(name, {}).get("output_tokens_per_s")
        if rate and base:
            lines.append(f"\n{name}: costs {1 - rate / base:.1%} against plain temperature 0.6 (target <= {limit:.0%})")
    for name in ("serving", "serving-async", "serving-inproc", "serving-1client"):
        serving = rows.get(name, {})
        if serving.get("output_tokens_per_s") and base:
            lines.append(f"\n{name} / offline (headline row, same engine arguments, workload, sampling): "
                         f"{serving['output_tokens_per_s'] / base:.2f} (target >= 0.9); "
                         f"TTFT p50 {serving['ttft_ms']['p50']:.0f} ms, TPOT p50 {serving['tpot_ms']['p50']:.1f} ms; "
                         f"API server {serving.get('server_cpu_us_per_token', '?')} µs CPU per token, client "
                         f"processes {serving.get('client_cpu_busy', '?')} of a core each")
    b1 = rows.get("batch1", {})
    if "tpot_ms" in b1:
        lines.append(f"\nbatch 1: decode step {b1['decode_step_ms_median']} ms median ({b1['tokens_per_step_median']} "
                     f"token(s) per step, {b1['decode_ms_per_token']} ms per token; target <= 1.0), TPOT through "
                     f"LLM.generate {b1['tpot_ms']} ms (target <= 1.2); profile: {b1.get('profile', {}).get('file')}, "
                     f"{b1.get('profile', {}).get('kernel_count')} kernels in one step")
    full = rows.get("full-batch", {})
    if "step_ms_median" in full:
        profile = full.get("profile", {})
        lines.append(f"\nfull batch ({full['batch']} sequences decoding): step {full['step_ms_median']} ms median, "
                     f"{full['ms_per_token_per_sequence']} ms per token, {full['output_tok_s_while_decoding']:,.0f} "
                     f"tok/s while decoding; profiled step: {profile.get('kernel_time_us', 0) / 1e3:.2f} ms of "
                     f"kernels in {profile.get('step_wall_ms')} ms wall ({profile.get('file')})")
    for name, r in rows.items():
        if r.get("timeline"):
            lines += ["", f"where {name}'s run time goes (one record per engine step):", ""] + timeline_table(r["timeline"])
    for r in rows.get("prefill-attn", {}).get("rows", []):
        lines.append(f"\nprefill attention {r['batch']} x {r['seq_len']}: paged Triton {r['paged_triton_ms']} ms, "
                     f"SDPA flash {r['sdpa_flash_ms']} ms: {r['paged_speed_vs_sdpa']:.2f}x SDPA's speed "
                     f"(target >= 0.8)")
    return lines


def timeline_table(timeline: dict) -> list[str]:
    lines = ["| phase | engine steps | seconds | share of time | output tokens | share of tokens | output tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for phase, t in timeline.items():
        rate = f"{t['output_tok_s']:,.0f}" if t["output_tok_s"] else ""
        lines.append(f"| {phase} | {t['steps']} | {t['seconds']} | {t['share_of_time']:.1%} | {t['output_tokens']:,} | "
                     f"{t['share_of_tokens']:.1%} | {rate} |")
    return lines


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every row (or --only some), each in its own process")
    run.add_argument("--out", required=True)
    run.add_argument("--smoke", action="store_true")
    run.add_argument("--budget-s", type=float, default=None)
    run.add_argument("--only", nargs="+", default=None, choices=ROW_NAMES)
    run.set_defaults(func=main)
    build_cmd = sub.add_parser("build")
    build_cmd.add_argument("--dir", required=True)
    build_cmd.add_argument("--models", nargs="+", required=True)
    build_cmd.add_argument("--smoke", action="store_true")
    build_cmd.set_defaults(func=build)
    prime_cmd = sub.add_parser("prime")
    prime_cmd.add_argument("--ckpt", required=True)
    prime_cmd.set_defaults(func=prime)
    row = sub.add_parser("row", help="one throughput row in this process (used by `run`)")
    row.add_argument("--spec", required=True, help="JSON: system, engine_args, sampling, num_seqs, ...")
    row.add_argument("--ckpt", required=True)
    row.add_argument("--result", required=True)
    row.add_argument("--device", default="cuda", help="transformers' device (minivllm picks its own)")
    row.set_defaults(func=run_row)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(cli())
