"""Start-up: from `import minivllm` to the first token, in a fresh process, with an empty and a filled kernel cache.

    python benchmarks/startup.py --out DIR            # Qwen3-0.6B shape on one GPU, about 2 minutes
    python benchmarks/startup.py --out /tmp/s --smoke  # the bundled model on the CPU, seconds

Each case is its own Python process, timed from its first line: `import minivllm` and
`from minivllm import LLM` (torch comes in here), then `LLM(...)` as nano-vllm's bench.py
builds it (model, dtype, max_model_len=4096, nothing else), then one greedy token of a
16-token prompt through `LLM.generate`. The cases, in order:

    empty   TRITON_CACHE_DIR is a new, empty folder: every Triton kernel compiles
    filled  the same folder again, as the empty case left it: every kernel loads from disk

`LLM()` is split by the engine's own start-up line (`minivllm/engine/startup_log.py`:
tokenizer, workers and weights, profile run, KV cache and graphs), the CUDA graph capture
line, and the model config line (`minivllm/config.py`): reading config.json, with the
imports it makes, the bulk of the config phase before the engine. Triton's JIT hooks
(`triton.knobs.runtime`) time every kernel build in the process, so the compile time shows
by phase (a build in the filled case is a load from disk). Each case also records whether
Python's compiled bytecode of torch and transformers was on disk when it started: without
it every process compiles those modules again, inside its import and config phases. The
checkpoint (random bf16 weights, benchmarks/common.py) is written by a process of its own
first, so the measured processes find it on disk like any model. Results go to
OUT/startup_<gpu>.json, the markdown table to the same name with .md, logs to OUT/logs/.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # the measured process's clock starts at its first line

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

MODEL = "qwen3-0.6b"
MAX_MODEL_LEN = 4096  # nano-vllm's bench.py: LLM(path, enforce_eager=False, max_model_len=4096)
PROMPT_TOKEN_IDS = list(range(1, 17))  # 16 ids below every model's vocabulary size, the bundled one's included
CASES = ("empty", "filled")
BUILD_TIMEOUT_S, CASE_TIMEOUT_S = 120, 150
TARGETS_S = {"empty": 20.0, "filled": 8.0}  # the project's targets, import to first token, one H100
# The engine's line (startup_log.py): "start-up <s> s: <phase> <s> s, <phase> <s> s, ..."
STARTUP_LINE = re.compile(r"start-up ([\d.]+) s: (.*)")
PHASE = re.compile(r"([^,]+?) ([\d.]+) s(?:,|$)")
GRAPHS_LINE = re.compile(r"captured CUDA graphs for (\d+) decode batch sizes .* and (\d+) prefill token counts .* "
                         r"in ([\d.]+) s")
HF_CONFIG_LINE = re.compile(r"model config: \S+ from (.+?) in ([\d.]+) s \((\d+) modules imported\)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="minivllm-startup-"))
    cache = tmp / "triton-cache"
    report: dict = {"command": " ".join(sys.argv), "smoke": args.smoke, "targets_s": TARGETS_S, "cases": {}}
    llm_args = {}  # --smoke: LLM(), the bundled model
    if not args.smoke:
        report["build"] = run_logged(out, "build", [sys.executable, __file__, "build", "--dir", str(tmp)],
                                     BUILD_TIMEOUT_S, {})
        llm_args = {"model": str(tmp / MODEL), "dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN}
    report["model"] = "the bundled model" if args.smoke else f"{MODEL} (random bf16 weights)"
    report["llm_args"] = {**llm_args, "model": MODEL} if llm_args else {}
    for case in CASES:
        result = tmp / f"{case}.json"
        cmd = [sys.executable, __file__, "measure", "--llm-args", json.dumps(llm_args), "--result", str(result)]
        status = run_logged(out, case, cmd, CASE_TIMEOUT_S, {"TRITON_CACHE_DIR": str(cache)})
        report["cases"][case] = {**(json.loads(result.read_text()) if result.exists() else {}), **status}
        report["cases"][case]["triton_cache_entries_after"] = len([e for e in cache.iterdir() if e.is_dir()]) \
            if cache.is_dir() else 0
    report["environment"] = next((c["environment"] for c in report["cases"].values() if "environment" in c), {})
    shutil.rmtree(tmp, ignore_errors=True)
    from common import result_path

    result_json = result_path("startup", report["environment"], out)
    result_json.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown_table(report)
    result_json.with_suffix(".md").write_text(table + "\n")
    print(table)
    return int(any("error" in c for c in report["cases"].values()))


def run_logged(out: Path, name: str, cmd: list[str], timeout_s: float, env: dict) -> dict:
    """{"process_s"} or {"error", ...}: the command's wall time, its output in OUT/logs/<name>.log."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(out / "logs" / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s} s"}
    wall = round(time.perf_counter() - start, 2)
    if proc.returncode:
        return {"error": f"exit status {proc.returncode}", "process_s": wall,
                "log_tail": (out / "logs" / f"{name}.log").read_text()[-800:]}
    return {"process_s": wall}


# --------------------------------------------------------------------------- the measured process
def measure(args: argparse.Namespace) -> int:
    """Import, `LLM()`, first token: seconds since this process's first line, with the log's phases."""
    bytecode = bytecode_on_disk(("torch", "transformers"))  # before anything imports them (a millisecond)
    import minivllm  # noqa: F401  (light: no torch)
    from minivllm import LLM, SamplingParams

    import_s = time.perf_counter() - PROCESS_START
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # into OUT/logs/<case>.log
    log = LogRecorder()
    builds = TritonBuildTimer()  # imports triton (minivllm's kernels would, inside LLM())
    hooks_s = time.perf_counter() - PROCESS_START - import_s
    start = time.perf_counter()
    llm = LLM(**json.loads(args.llm_args))
    llm_s = time.perf_counter() - start
    num_built_in_llm = len(builds.builds)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": PROMPT_TOKEN_IDS}], params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    first_token_s = time.perf_counter() - PROCESS_START
    if len(outputs[0].outputs[0].token_ids) != 1:
        raise RuntimeError("the first-token request did not return one token.")
    device = str(llm.llm_engine.device_config.device)
    from common import environment

    found = parse_engine_log(log.messages)
    result = {"import_s": round(import_s, 2), "llm_s": round(llm_s, 2), "first_token_s": round(first_token_s, 2),
              "generate_s": round(generate_s, 2), "triton_hooks_s": round(hooks_s, 2), **found,
              "triton_hooks": builds.installed,
              "triton_builds_in_llm": summarize(builds.builds[:num_built_in_llm]),
              "triton_builds_in_generate": summarize(builds.builds[num_built_in_llm:]),
              "device": device, "bytecode": bytecode, "engine_log": [m for _, m in log.messages],
              "environment": environment(device)}
    if "phases_s" in found:
        # LLM() before the engine's own clock: EngineArgs -> EngineConfig (the model config line).
        result["phases_s"] = {"config": round(llm_s - found["engine_startup_s"], 2), **found["phases_s"]}
        result["triton_build_s_by_phase"] = builds_by_phase(builds.builds[:num_built_in_llm], found)
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0


def bytecode_on_disk(packages: tuple[str, ...]) -> dict:
    """{"dont_write_bytecode", package: whether its __init__'s compiled bytecode exists}, found
    without importing the package (`PYTHONPYCACHEPREFIX`, if set, is where Python looks)."""
    import importlib.util

    found: dict = {"dont_write_bytecode": bool(sys.flags.dont_write_bytecode)}
    for name in packages:
        spec = importlib.util.find_spec(name)
        found[name] = bool(spec and spec.cached and os.path.exists(spec.cached))
    return found


class LogRecorder(logging.Handler):
    """Keeps every INFO record of the `minivllm` loggers as (time.time() it was made, message)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[float, str]] = []
        root = logging.getLogger("minivllm")
        root.setLevel(logging.INFO)
        root.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.created, record.getMessage()))


def parse_engine_log(messages: list[tuple[float, str]]) -> dict:
    """{"engine_startup_s", "engine_startup_logged_at", "phases_s": {phase: s}, "graph_capture_s",
    "graph_batch_sizes", "prefill_graph_sizes", "hf_config_s", "hf_config_modules", "hf_config_from"}
    from the start-up line, the graph capture line and the (first) model config line."""
    found: dict = {}
    for created, message in messages:
        if match := STARTUP_LINE.match(message):
            found["engine_startup_s"], found["engine_startup_logged_at"] = float(match.group(1)), created
            found["phases_s"] = {name.strip(): float(s) for name, s in PHASE.findall(match.group(2))}
        elif match := GRAPHS_LINE.match(message):
            found["graph_batch_sizes"], found["prefill_graph_sizes"] = int(match.group(1)), int(match.group(2))
            found["graph_capture_s"] = float(match.group(3))
        elif (match := HF_CONFIG_LINE.match(message)) and "hf_config_s" not in found:
            found["hf_config_from"] = match.group(1)
            found["hf_config_s"], found["hf_config_modules"] = float(match.group(2)), int(match.group(3))
    return found


def builds_by_phase(builds: list[tuple[str, float, float]], found: dict) -> dict:
    """Seconds of Triton builds in each engine phase: the phases laid end to end from the
    engine's start (the start-up line's time minus its total); a build before it is "config"."""
    start = at = found["engine_startup_logged_at"] - found["engine_startup_s"]
    ends = []
    for name, seconds in found["phases_s"].items():
        at += seconds
        ends.append((at, name))
    by_phase: dict[str, float] = {}
    for _, began, seconds in builds:
        phase = "config" if began < start else next((name for end, name in ends if began < end), ends[-1][1])
        by_phase[phase] = round(by_phase.get(phase, 0.0) + seconds, 2)
    return by_phase


class TritonBuildTimer:
    """Times each Triton kernel build in this process through Triton's JIT hooks: the cache
    hook runs just before a build (a compile, or a load from the disk cache), the
    post-compile hook just after. `installed` is False where this Triton has no such hooks."""

    def __init__(self) -> None:
        self.builds: list[tuple[str, float, float]] = []  # (kernel, time.time() at its start, seconds)
        self.started = self.started_at = 0.0
        try:
            from triton import knobs
        except ImportError:
            self.installed = False
            return
        runtime = knobs.runtime
        self.installed = hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")
        if self.installed:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self.before, self.after

    def before(self, *args, **kwargs) -> bool:
        self.started, self.started_at = time.perf_counter(), time.time()
        return False  # build it: True would skip the build

    def after(self, *args, **kwargs) -> None:
        fn = kwargs.get("fn")
        self.builds.append((getattr(fn, "name", "?"), self.started_at, time.perf_counter() - self.started))


def summarize(builds: list[tuple[str, float, float]]) -> dict:
    """{"count", "seconds", "kernels": {name: [builds, seconds]}}, the slowest kernels first."""
    kernels: dict[str, list] = {}
    for name, _, seconds in builds:
        entry = kernels.setdefault(name, [0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + seconds
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"count": len(builds), "seconds": round(sum(s for _, _, s in builds), 2),
            "kernels": {name: [n, round(s, 3)] for name, (n, s) in ranked}}


# --------------------------------------------------------------------------- the table
def markdown_table(report: dict) -> str:
    env = report.get("environment", {})
    lines = [f"Start-up, {report['model']}, {env.get('gpu', 'CPU')} ({env.get('date', '?')}, commit "
             f"{env.get('commit', '?')}): seconds from the process's first line",
             "", "| Triton cache | Python bytecode | import | LLM() | first token | Triton builds in LLM() | LLM() phases |",
             "|---|---|---|---|---|---|---|"]
    for case, r in report["cases"].items():
        if "error" in r:
            lines.append(f"| {case} | | {r['error']} | | | | |")
            continue
        built_in = r.get("triton_build_s_by_phase", {})
        phases = ", ".join(f"{name} {s:.1f}" + (f" (Triton {built_in[name]:.1f})" if built_in.get(name) else "")
                           + (f" (model config {r['hf_config_s']:.1f} from {r['hf_config_from']}, "
                              f"{r['hf_config_modules']} modules)"
                              if name == "config" and "hf_config_s" in r else "")
                           for name, s in r.get("phases_s", {}).items())
        if "graph_capture_s" in r:
            phases += (f" (graph capture {r['graph_capture_s']:.1f}: {r['graph_batch_sizes']} decode, "
                       f"{r.get('prefill_graph_sizes', 0)} prefill)")
        builds = r["triton_builds_in_llm"]
        built = f"{builds['count']} in {builds['seconds']:.1f} s" if r.get("triton_hooks") else "no hooks"
        target = report["targets_s"].get(case)
        first = f"{r['first_token_s']:.1f}" + (f" (target {target:.0f})" if target and not report["smoke"] else "")
        bytecode = r.get("bytecode", {})
        on_disk = "on disk" if bytecode.get("transformers") and bytecode.get("torch") else "compiled in the process"
        lines.append(f"| {case} | {on_disk} | {r['import_s']:.1f} | {r['llm_s']:.1f} | {first} | {built} | {phases} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the checkpoint
def build(args: argparse.Namespace) -> int:
    from common import build_checkpoint

    build_checkpoint(MODEL, Path(args.dir), "cuda")
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="where the JSON, the table and the logs go")
    parser.add_argument("--smoke", action="store_true", help="the bundled model on the CPU")
    parser.set_defaults(func=main)
    sub = parser.add_subparsers()
    build_cmd = sub.add_parser("build")
    build_cmd.add_argument("--dir", required=True)
    build_cmd.set_defaults(func=build)
    measure_cmd = sub.add_parser("measure")
    measure_cmd.add_argument("--llm-args", required=True, help="JSON: LLM()'s keyword arguments")
    measure_cmd.add_argument("--result", required=True)
    measure_cmd.set_defaults(func=measure)
    args = parser.parse_args()
    if args.func is main and not args.out:
        parser.error("--out is required")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(arguments.func(arguments))
