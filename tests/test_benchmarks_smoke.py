"""The benchmark scripts run end to end on the CPU (tiny model), and measure what they say.

The GPU numbers come from `python benchmarks/nano_vllm_workload.py run --out DIR` (and the
other scripts) on the GPU machine; here we check the same code paths in seconds: the workload
is nano-vllm's bench.py draw, every row records the engine arguments and sampling it used and
checks each request's token count, the budget skips rows rather than overrunning, and the
scripts import one shared module without a cycle.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The scripts import their shared module by name; their folder is on sys.path only while they
# are imported, since it also holds `kernels.py`, which must never shadow the `kernels` name in
# this process (tests/test_architecture.py checks it).
sys.path.insert(0, str(BENCHMARKS))
try:
    import common  # noqa: E402
    import nano_vllm_workload  # noqa: E402
    import startup  # noqa: E402
finally:
    sys.path.remove(str(BENCHMARKS))


def test_workload_is_nano_vllm_bench_draw():
    """bench.py: `seed(0)`, prompts (length, then ids) first, then one max_tokens per request."""
    import random

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert common.make_workload() == (prompts, max_tokens)
    assert sum(max_tokens) == 133_966  # the output-token count nano-vllm's bench.py reports


def test_row_workload_caps_only_when_asked():
    prompts, max_tokens = common.row_workload({"num_seqs": 3, "prompt_cap": 5, "max_tokens_cap": 7})
    full_prompts, full_max = common.make_workload()
    assert prompts == [p[:5] for p in full_prompts[:3]]
    assert max_tokens == [min(m, 7) for m in full_max[:3]]
    assert common.row_workload({}) == (full_prompts, full_max)


def test_headline_row_changes_no_engine_argument():
    """The headline is `LLM()` defaults at temperature 0.6: no engine_args in its spec."""
    headline = next(row for row in nano_vllm_workload.ROWS if row.name == "headline")
    assert "engine_args" not in headline.spec and "system" not in headline.spec
    assert headline.spec["sampling"] == {"temperature": 0.6}
    assert headline is nano_vllm_workload.ROWS[0]


def test_budget_skips_a_row_instead_of_starting_it(tmp_path):
    runner = nano_vllm_workload.Runner(tmp_path, budget_s=nano_vllm_workload.MIN_ROW_S - 1)
    marker = tmp_path / "ran"
    status = runner.run("x", [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], timeout_s=60)
    assert status["error"].startswith("skipped") and not marker.exists()


def test_a_row_past_its_timeout_is_killed(tmp_path):
    runner = nano_vllm_workload.Runner(tmp_path, budget_s=60, min_row_s=0.5)
    status = runner.run("slow", [sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=2)
    assert status["error"].startswith("timed out") and status["wall_s"] < 10


def test_nano_vllm_workload_smoke_end_to_end(tmp_path):
    """One row of each kind through the real entry point (each its own process), on the CPU."""
    cmd = [sys.executable, str(BENCHMARKS / "nano_vllm_workload.py"), "run", "--smoke", "--out", str(tmp_path),
           "--only", "headline", "prefill-attn", "batch1", "full-batch", "serving", "serving-inproc"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "nano_vllm_workload_cpu.json").read_text())  # named for the benchmark and machine
    rows = report["rows"]
    assert set(rows) == {"headline", "prefill-attn", "batch1", "full-batch", "serving", "serving-inproc"}
    assert not [name for name, r in rows.items() if "error" in r], rows

    headline = rows["headline"]
    assert headline["tokens_checked"] and headline["output_tokens"] == headline["num_requests"] * 8
    assert headline["sampling_params"] == {"temperature": 0.6, "ignore_eos": True}
    defaults = common.engine_args_used({})
    changed = {k for k, v in headline["engine_args"].items() if v != defaults[k]}
    assert changed == {"model", "dtype", "max_model_len"}  # only what nano-vllm's bench.py gives
    assert headline["engine_args"]["max_model_len"] == 4096
    assert "Benchmark: " in headline["warmup"]

    for shape in rows["prefill-attn"]["rows"]:  # the paged kernel computes what SDPA computes
        assert shape["relative_error_vs_sdpa"] < 1e-4 and shape["paged_triton_ms"] > 0

    batch1 = rows["batch1"]
    assert batch1["tokens_checked"] and batch1["tpot_ms"] > 0 and batch1["decode_step_ms_median"] > 0
    assert Path(batch1["profile"]["file"]).read_text().startswith("One decode step()")

    full = rows["full-batch"]  # every request decoding when the step is timed and profiled
    assert full["batch"] == 4 and full["step_ms_median"] > 0
    assert Path(full["profile"]["file"]).read_text().startswith("One decode step() at batch 4")

    for name in ("serving", "serving-inproc"):  # the engine in its own process, and in the server's
        serving = rows[name]
        assert serving["tokens_checked"] and serving["completed"] == serving["num_requests"] == 4
        # Token by token unless the server fell behind its engine (then a chunk carries several).
        assert serving["num_requests"] < serving["streamed_chunks"] <= serving["output_tokens"]
        assert serving["output_tokens_per_s"] > 0
    assert "--disable-frontend-multiprocessing" in rows["serving-inproc"]["server_cmd"]
    assert "--disable-frontend-multiprocessing" not in rows["serving"]["server_cmd"]
    assert rows["serving"]["client_processes"] == nano_vllm_workload.SERVING_CLIENT_PROCESSES > 1

    table = (tmp_path / "nano_vllm_workload_cpu.md").read_text()
    assert "nano-vllm bench.py" in table and "serving / offline" in table and "full batch (4 sequences" in table


def test_transformers_peer_row_runs_on_the_cpu(tmp_path):
    """The headline's peer, transformers' continuous batching, through the same runner: every
    request checked, sampling at the row's temperature alone (top-k 0, top-p 1)."""
    cmd = [sys.executable, str(BENCHMARKS / "nano_vllm_workload.py"), "run", "--smoke", "--out", str(tmp_path),
           "--only", "hf-cb"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    peer = json.loads((tmp_path / "nano_vllm_workload_cpu.json").read_text())["rows"]["hf-cb"]
    assert peer["tokens_checked"] and peer["output_tokens"] == peer["num_requests"] * 8
    assert peer["sampling_params"] == {"temperature": 0.6, "top_k": 0, "top_p": 1.0, "ignore_eos": True}


@pytest.mark.parametrize("name", ["greedy", "top-p-k", "penalties", "ms16", "eager", "llama-1b", "hf-cb", "serving-inproc", "serving-1client"])
def test_every_extra_row_is_labelled(name):
    row = next(row for row in nano_vllm_workload.ROWS if row.name == name)
    assert row.label and row.label != nano_vllm_workload.ROWS[0].label


def test_progress_logger_says_how_far_an_unfinished_row_got(tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "row.progress.json"
    logger = common.ProgressLogger(path)
    logger.log(SimpleNamespace(num_generation_tokens_iter=5, now=logger.start + 0.1))
    assert not path.exists()  # written every PROGRESS_EVERY_S only
    logger.log(SimpleNamespace(num_generation_tokens_iter=7, now=logger.start + common.PROGRESS_EVERY_S + 1))
    progress = json.loads(path.read_text())
    assert progress["output_tokens_so_far"] == 12 and progress["seconds_so_far"] > common.PROGRESS_EVERY_S
    report = {"labels": {"penalties": "penalties row"},
              "rows": {"penalties": {"error": "timed out after 80 s", "partial": progress}}}
    assert "penalties row: timed out after 80 s (unfinished: 12 tokens" in nano_vllm_workload.markdown_table(report)


def test_a_stalled_step_names_the_triton_kernels_built_in_it():
    """The step timeline's stall record lists the builds of that step alone, from the timer's list."""
    from types import SimpleNamespace

    builds = [("_warm_kernel", 0.0, 0.004)]  # built before the run: never charged to a step
    timeline = common.StepTimeline(builds=builds)
    step = lambda now: SimpleNamespace(now=now, num_prompt_tokens_iter=0, num_generation_tokens_iter=8,
                                       num_running_sys=4)
    timeline.log(step(timeline.last + 0.02))
    builds.append(("_paged_prefill_kernel", 0.0, 0.6))  # a compile inside the next step
    timeline.log(step(timeline.last + 0.65))
    timeline.log(step(timeline.last + 0.02))
    [stall] = timeline.stalls
    assert stall["step"] == 1 and stall["triton_builds"] == [["_paged_prefill_kernel", 600.0]]
    plain = common.StepTimeline()  # no timer (a Triton without the hooks): no such field
    plain.log(step(plain.last + 0.02))
    plain.log(step(plain.last + 0.65))
    assert plain.stalls and "triton_builds" not in plain.stalls[0]


def test_serving_split_runs_each_layer(tmp_path):
    """benchmarks/serving_split.py on the CPU: the offline modes (a ramp included) and the engine
    process each deliver the whole workload (the script checks every stream's token count)."""
    ckpt = common.build_checkpoint("qwen3-0.6b", tmp_path, "cpu", nano_vllm_workload.SMOKE_CONFIG)
    reports = []
    for layer, modes in (("offline", ["final", "delta-wire", "cumulative-wire:0.05"]), ("mq", ["delta", "cumulative"])):
        run = subprocess.run([sys.executable, str(BENCHMARKS / "serving_split.py"), "--smoke", str(ckpt), layer, *modes],
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-2000:]
        reports += [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in reports] == ["offline final", "offline delta-wire", "offline cumulative-wire:0.05",
                                           "mq delta", "mq cumulative"]
    assert all(r["output_tokens_per_s"] > 0 for r in reports)


def test_kv_transfer_phases_round_trip_exactly():
    """benchmarks/kv_transfer.py on tiny CPU shapes: every phase runs and the blocks come back
    bit for bit (its exit status says so)."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "kv_transfer.py"), "--device", "cpu", "--small"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout[run.stdout.index("{\n"):])
    assert len(report["rounds"]) == 3 and all(r["round_trip_exact"] for r in report["rounds"])
    assert {"finish_save", "put_many (files)", "get + decode", "loads done"} <= set(report["rounds"][0]["ms"])


def test_gpu_idle_gaps_charges_each_hole_to_the_host_phase_it_overlaps():
    """The GPU-idle profile's arithmetic: the union of overlapping kernels is busy time; a
    hole of at least min_gap is idle, split between the labelled host phases over it."""
    kernels = [(0, 10), (5, 12), (12.5, 20), (40, 50), (50, 52), (70, 80)]
    phases = [("schedule", 15, 30), ("process outputs", 60, 65)]
    busy, gaps, by_phase = common.gpu_idle_gaps(kernels, phases, min_gap=1.0)
    assert busy == 12 + 7.5 + 10 + 2 + 10  # [0, 12] once, the 0.5 hole is launch spacing
    assert gaps == [(20, 40), (52, 70)]
    assert by_phase == {"schedule": 10, "process outputs": 5, "other": 10 + 13}


def test_all_reduce_waits_splits_each_collective_into_its_own_time_and_a_wait():
    """The per-rank profile's arithmetic: all-reduces of two ranks that overlap are one
    collective, and both leave it together, so the later starter's duration is the op's own
    time and the earlier one waited the difference. A kernel with no partner is left out; the
    step's first collective (where a rank that began the step late is waited for) stands apart."""
    rank0 = [("ar", 0, 30), ("ar", 100, 10), ("ar", 200, 12), ("ar", 300, 10)]
    rank1 = [("ar", 20, 10), ("ar", 95, 15), ("ar", 150, 5), ("ar", 201, 11), ("ar", 303, 7)]
    waits = common.all_reduce_waits(rank0, rank1)
    assert waits["paired_all_reduces"] == 4
    assert waits["own_time_ms"] == (10 + 10 + 11 + 7) / 1e3
    assert (waits["first_rank0_waited_us"], waits["first_rank1_waited_us"]) == (20, 0)
    assert waits["rank0_waited_ms"] == (0 + 1 + 3) / 1e3 and waits["rank1_waited_ms"] == 5 / 1e3
    assert waits["rank0_waited_in"] == 2 and waits["wait_median_us"] == 3
    assert waits["end_spread_median_us"] == 0


def test_the_fused_all_reduce_kernels_count_as_all_reduces():
    """Every collective of a TP step is paired across the ranks: the decoder's fused kernels
    (their Triton names in a trace), PyTorch's and NCCL's; a norm or a GEMM is not one."""
    from minivllm.kernels import custom_all_reduce

    fused = [name for name in dir(custom_all_reduce) if name.endswith("_kernel") and name.startswith("_")]
    assert sorted(fused) == ["_one_shot_kernel", "_two_shot_kernel"]
    assert all(common.is_all_reduce(name) for name in fused)
    assert common.is_all_reduce("void (anonymous namespace)::two_shot_all_reduce_kernel<c10::BFloat16, 16, 2>")
    assert common.is_all_reduce("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert not any(common.is_all_reduce(name) for name in ("_rms_norm_kernel", "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT",
                                                           "ncclDevKernel_Broadcast_RING_LL"))


def _sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The benchmarks/ modules that `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & siblings - {path.stem}


def test_benchmark_scripts_import_no_cycle_and_share_one_helper_module():
    """Every script reaches its shared code through common.py; no two scripts import each other
    in a circle (an import graph with a cycle has no order in which to load its modules)."""
    scripts = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph = {name: _sibling_imports(path, set(scripts)) for name, path in scripts.items()}
    assert graph["common"] == set()  # the shared module imports no script
    done, visiting = set(), []

    def visit(name: str) -> None:
        assert name not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(name):] + [name])}"
        if name in done:
            return
        visiting.append(name)
        for imported in sorted(graph[name]):
            visit(imported)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert {"common"} <= set().union(*graph.values())


def test_gpu_tag_names_a_result_for_its_machine():
    assert common.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert common.gpu_tag("NVIDIA H200", 2) == "h200x2"
    assert common.gpu_tag(None) == "cpu"
    env = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1}
    assert common.result_path("throughput", env, Path("out")) == Path("out/throughput_h100.json")


def test_clock_summary_reads_nvidia_smi_samples_and_skips_the_rest():
    lines = "1980, 455.20, 41\n345, 88.10, 38\n[N/A], [N/A], 39\n1755, 690.00, 52\n1980, 51"
    assert common.clock_summary(lines) == {"samples": 3, "sm_mhz_min": 345.0, "sm_mhz_median": 1755.0,
                                           "power_w_max": 690.0, "temperature_c_max": 52.0}
    assert common.clock_summary("") == {}


def test_gpu_clocks_records_nothing_without_a_gpu():
    with common.gpu_clocks("cpu") as clocks:
        pass
    assert clocks == {}


def test_gpu_clocks_samples_while_the_block_runs_and_stops_the_sampler(tmp_path, monkeypatch):
    """The sampling process (a stand-in nvidia-smi here) runs for the block and no longer."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nwhile true; do echo '1980, 400.5, 40'; sleep 0.02; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common, "_nvidia_smi_id", lambda device: "GPU-0")
    started = []
    popen = common.subprocess.Popen
    monkeypatch.setattr(common.subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    with common.gpu_clocks("cuda:0", every_ms=20) as clocks:
        time.sleep(0.3)
    assert started and started[0].poll() is not None  # the sampler has exited
    assert clocks["samples"] >= 2 and clocks["sm_mhz_min"] == clocks["sm_mhz_median"] == 1980.0
    assert clocks["power_w_max"] == 400.5 and clocks["temperature_c_max"] == 40.0


def test_commit_prefers_the_one_named_in_the_environment(monkeypatch):
    """A copy whose .git is another tree's (a device's stale checkout) names its commit itself."""
    monkeypatch.setenv("MINIVLLM_COMMIT", "abc1234")
    assert common.commit() == "abc1234"
    monkeypatch.delenv("MINIVLLM_COMMIT")
    assert common.commit() != "abc1234"


def test_startup_reads_the_engine_log_and_charges_each_triton_build_to_its_phase():
    logged_at = 1000.0  # the start-up line's time: the engine started 4 s before it, at 996
    messages = [(998.0, "captured CUDA graphs for 3 decode batch sizes [1, 2, 4] and 1 prefill token counts [512] in 1.25 s"),
                (logged_at, "start-up 4.00 s: tokenizer 0.50 s, workers and weights 1.00 s, profile run 1.00 s, "
                            "KV cache and graphs 1.50 s")]
    found = startup.parse_engine_log(messages)
    assert found["engine_startup_s"] == 4.0 and found["graph_capture_s"] == 1.25
    assert (found["graph_batch_sizes"], found["prefill_graph_sizes"]) == (3, 1)
    assert found["phases_s"] == {"tokenizer": 0.5, "workers and weights": 1.0, "profile run": 1.0,
                                 "KV cache and graphs": 1.5}
    builds = [("a", 995.0, 0.1), ("b", 997.6, 0.3), ("c", 998.0, 0.2), ("d", 999.0, 0.5)]
    assert startup.builds_by_phase(builds, found) == {"config": 0.1, "profile run": 0.5, "KV cache and graphs": 0.5}


def test_startup_smoke_end_to_end(tmp_path):
    """benchmarks/startup.py --smoke: both cases in fresh processes on the bundled model, LLM() split
    into the engine's logged phases, a markdown table."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "startup.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "startup_cpu.json").read_text())
    assert list(report["cases"]) == ["empty", "filled"]
    for case in report["cases"].values():
        assert "error" not in case, case
        assert list(case["phases_s"]) == ["config", "tokenizer", "workers and weights", "profile run",
                                          "KV cache and graphs"]
        assert all(s >= 0 for s in case["phases_s"].values())
        assert 0 < case["import_s"] < case["first_token_s"] and case["llm_s"] >= case["engine_startup_s"] > 0
        assert case["import_s"] + case["llm_s"] + case["generate_s"] <= case["first_token_s"]
    table = (tmp_path / "startup_cpu.md").read_text()
    assert "| empty |" in table and "| filled |" in table and "workers and weights" in table


def test_startup_times_triton_builds_through_its_jit_hooks():
    """The hooks as Triton calls them (keyword arguments; the cache hook's False lets the build go on)."""
    from types import SimpleNamespace

    knobs = pytest.importorskip("triton").knobs
    previous = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        timer = startup.TritonBuildTimer()
        assert timer.installed and knobs.runtime.jit_cache_hook == timer.before
        assert knobs.runtime.jit_cache_hook(key="k", repr="r", fn=SimpleNamespace(name="kernel"), compile={},
                                            is_manual_warmup=False, already_compiled=False) is False
        knobs.runtime.jit_post_compile_hook(key="k", repr="r", fn=SimpleNamespace(name="kernel"), compile={},
                                            is_manual_warmup=False, already_compiled=False)
        assert [(name, seconds >= 0) for name, _, seconds in timer.builds] == [("kernel", True)]
        assert startup.summarize(timer.builds)["kernels"]["kernel"][0] == 1
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = previous
