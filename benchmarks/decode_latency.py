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

--batch1 (issue 15) measures batch 1 with `LLM()` defaults instead: the median decode step,
time per output token through LLM.generate (128-token prompt, 512 greedy tokens) and a
torch.profiler table of one decode step (profile_batch1_decode_step.txt in --profile-dir).
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
    if not enforce_eager and runner.graph_runners:  # (none on a CPU smoke run)
        graph = runner.graph_runners[min(s for s in runner.graph_runners if s >= batch)].graph
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


def cuda_median_ms(fn, reps: int) -> float:
    if not torch.cuda.is_available():  # CPU smoke tests
        return _median_wall_ms(fn, reps)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _median_wall_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


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


# ----------------------------------------------------------------- batch 1, LLM() defaults (issue 15)
B1_PROMPT_LEN, B1_STEPS, B1_WARMUP_STEPS, B1_GEN_TOKENS, B1_REPS = 128, 64, 8, 512, 3
B1_MAX_MODEL_LEN = 4096  # as nano-vllm's bench.py
B1_TOP_KERNELS = 25
FULL_STEPS = 6  # engine steps timed at the full batch (each several tokens with multi-step)


def batch1(ckpt: str, profile_path: Path | None, smoke: bool = False) -> dict:
    """Batch-1 latency with `LLM()` defaults (model, dtype, max_model_len only):

    decode step   median wall time of LLMEngine.step() over B1_STEPS decode steps of one request
                  (128-token prompt) after warm-up; with multi-step defaults one step() yields
                  several tokens, so ms per token = total time / tokens those steps produced
    TPOT          through LLM.generate: (time of 512 greedy tokens - time of 1 token) / 511,
                  each the median of B1_REPS runs (the difference removes the prefill and TTFT)
    profile       torch.profiler over one decode step(): top kernels by GPU time, kernel count
    """
    from minivllm import LLM, SamplingParams

    steps, gen_tokens = (8, 16) if smoke else (B1_STEPS, B1_GEN_TOKENS)
    given = {"model": ckpt, "dtype": "float32" if smoke else "bfloat16", "max_model_len": B1_MAX_MODEL_LEN}
    llm = LLM(**given)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": [random.Random(1).randrange(10000) for _ in range(B1_PROMPT_LEN)]}
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([prompt], SamplingParams(**greedy, max_tokens=gen_tokens), use_tqdm=False)  # warm-up
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import engine_args_used, resolved_engine_settings

    result = {"engine_args": engine_args_used(given), "engine_resolved": resolved_engine_settings(engine),
              "prompt_len": B1_PROMPT_LEN, "num_scheduler_steps": engine.scheduler_config.num_scheduler_steps}
    engine.add_request("b1", prompt, SamplingParams(**greedy, max_tokens=B1_MAX_MODEL_LEN - B1_PROMPT_LEN - 64))
    while not engine.scheduler.running or engine.scheduler.running[0].is_prefill():
        engine.step()
    seq = engine.scheduler.running[0].first_seq
    for _ in range(B1_WARMUP_STEPS):
        engine.step()
    times, tokens = [], []
    for _ in range(steps):
        before, start = seq.get_output_len(), time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        tokens.append(seq.get_output_len() - before)
    result.update(decode_step_ms_median=round(1e3 * sorted(times)[len(times) // 2], 4),
                  tokens_per_step_median=sorted(tokens)[len(tokens) // 2],
                  decode_ms_per_token=round(1e3 * sum(times) / max(1, sum(tokens)), 4),
                  decode_steps_timed=steps, target_decode_ms=1.0)
    if profile_path is not None:
        result["profile"] = profile_one_step(engine, seq, profile_path)
        result["host_profile"] = profile_host(engine, 2 if smoke else 3 * HOST_PROFILE_STEPS,
                                              profile_path.with_name("profile_batch1_host.txt"))
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
    import sys

    from minivllm import LLM, SamplingParams
    from minivllm.engine.llm_engine import TORCH_PROFILER_DIR_ENV
    from minivllm.sampling_params import RequestOutputKind

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import NANO_MAX_MODEL_LEN, engine_args_used, make_workload

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


HOST_PROFILE_STEPS = 4
IDLE_PROFILE_STEPS = 3  # engine steps in the GPU-idle profile (the gaps between them count)
IDLE_GAP_US = 20.0  # a gap between kernels shorter than this is launch spacing, not idleness

# Host phases labelled in the GPU-idle profile: (label, owner attribute path, method).
_HOST_PHASES = (("schedule", "scheduler", "schedule"),
                ("process outputs", "", "_process_model_outputs"),
                ("report", "", "_report"),
                ("free finished", "scheduler", "free_finished_seq_groups"))


def profile_gpu_idle(engine, steps: int, path: Path) -> dict:
    """`GpuIdleProfile` over the next `steps` engine steps, its summary written to `path`."""
    profiler = GpuIdleProfile(engine)
    profiler.start()
    for _ in range(steps):
        engine.step()
    return profiler.stop(steps, path)


class GpuIdleProfile:
    """When is the GPU idle, and what is the host doing then? torch.profiler over some
    consecutive engine steps with the host's phases labelled (`record_function`): every gap
    of at least IDLE_GAP_US between kernels on the GPU is charged to the labelled host
    phases it overlaps ("other" for the rest: stepping the generator, Python between
    phases). The sum of the gaps is what an overlap of host and GPU could win at most.

    Also an engine stat logger (`log`): added with `at_step`, it profiles engine steps
    at_step .. at_step + steps - 1 of whatever drives the engine (`LLM.generate`)."""

    def __init__(self, engine, at_step: int | None = None, steps: int = IDLE_PROFILE_STEPS,
                 path: Path | None = None) -> None:
        self.engine, self.at_step, self.steps, self.path = engine, at_step, steps, path
        self.num_logged, self.prof, self.summary = 0, None, None

    def log(self, stats) -> None:
        self.num_logged += 1
        if self.num_logged == self.at_step:
            self.start()
        elif self.prof is not None and self.num_logged == self.at_step + self.steps:
            self.stop(self.steps, self.path)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        runner = self.engine.model_executor.driver_worker.model_runner
        patched = [(self.engine if not owner else getattr(self.engine, owner), method) for _, owner, method in _HOST_PHASES]
        patched += [(getattr(runner, "base", runner), "prepare_model_input")]
        self.labels = [label for label, _, _ in _HOST_PHASES] + ["prepare inputs"]
        self.patched = [(obj, method, getattr(obj, method)) for obj, method in patched]
        for (obj, method, original), label in zip(self.patched, self.labels):
            setattr(obj, method, _labelled(original, label, record_function))
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.prof.start()
        self.started = time.perf_counter()

    def stop(self, steps: int, path: Path | None) -> dict:
        from torch.autograd import DeviceType

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - self.started)
        self.prof.stop()
        for obj, method, original in self.patched:
            if method in vars(obj):
                delattr(obj, method)  # back to the class's method
            else:
                setattr(obj, method, original)
        events = self.prof.events()
        self.prof = None
        kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
        phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
                  if e.device_type == DeviceType.CPU and e.name in self.labels]
        busy_us, gaps, idle_by_phase = gpu_idle_gaps(kernels, phases, IDLE_GAP_US)
        span_us = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
        first = kernels[0][0] if kernels else 0.0
        self.summary = {
            "steps": steps, "wall_ms": round(wall_ms, 2), "kernel_span_ms": round(span_us / 1e3, 2),
            "gpu_busy_ms": round(busy_us / 1e3, 2), "gpu_idle_ms": round(sum(e - b for b, e in gaps) / 1e3, 2),
            "idle_ms_by_host_phase": {k: round(v / 1e3, 2) for k, v in sorted(idle_by_phase.items(), key=lambda kv: -kv[1])},
            "largest_gaps": [{"at_ms": round((b - first) / 1e3, 2), "ms": round((e - b) / 1e3, 3)}
                             for b, e in sorted(gaps, key=lambda g: g[0] - g[1])[:10]]}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.summary, indent=1) + "\n")
        return self.summary


def gpu_idle_gaps(kernels: list[tuple[float, float]], phases: list[tuple[str, float, float]],
                  min_gap: float) -> tuple[float, list[tuple[float, float]], dict[str, float]]:
    """(busy time, idle gaps, idle time by host phase) from kernel intervals (start, end),
    sorted by start, and labelled host intervals (name, start, end), all in one clock. A gap
    is a hole of at least `min_gap` in the union of the kernels; the part of it that no
    labelled phase overlaps is charged to "other"."""
    gaps, busy, reach = [], 0.0, None
    for begin, end in kernels:
        if reach is not None and begin - reach >= min_gap:
            gaps.append((reach, begin))
        busy += max(0.0, end - max(begin, reach if reach is not None else begin))
        reach = end if reach is None else max(reach, end)
    idle_by_phase: dict[str, float] = {}
    for begin, end in gaps:
        covered = 0.0
        for name, p_begin, p_end in phases:
            overlap = min(end, p_end) - max(begin, p_begin)
            if overlap > 0:
                idle_by_phase[name] = idle_by_phase.get(name, 0.0) + overlap
                covered += overlap
        idle_by_phase["other"] = idle_by_phase.get("other", 0.0) + max(0.0, end - begin - covered)
    return busy, gaps, idle_by_phase


def _labelled(fn, label: str, record_function):
    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return call




def profile_host(engine, steps: int, path: Path) -> dict:
    """cProfile over `steps` engine steps: the host's Python, by own time (what the GPU waits
    for between multi-step runs is in here: scheduling, batch building, output processing)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    wall_ms = 1e3 * (time.perf_counter() - start)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"cProfile over {steps} engine steps, {wall_ms:.1f} ms wall (profiler overhead included)\n"
                    + text.getvalue())
    return {"file": str(path), "steps": steps, "wall_ms": round(wall_ms, 1)}


def profile_one_step(engine, seq, path: Path, label: str = "at batch 1") -> dict:
    """torch.profiler over one decode step(): a table of the top kernels by GPU time and the
    kernel count, written to `path`; a summary returned. `seq` counts the step's tokens."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    before = seq.get_output_len()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - start)
    step_tokens = seq.get_output_len() - before
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())  # a kernel's own duration
    total_us = sum(sum(v) for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:B1_TOP_KERNELS]
    lines = [f"One decode step() {label} ({step_tokens} token(s) per sequence): wall {wall_ms:.3f} ms, {len(kernels)} GPU "
             f"kernels, {total_us:.1f} us of kernel time", "",
             f"{'GPU us':>10} {'share':>6} {'calls':>6}  kernel"]
    lines += [f"{sum(v):10.1f} {sum(v) / total_us:6.1%} {len(v):6d}  {name[:120]}" for name, v in ranked] if total_us else []
    sort_key = "device_time_total" if cuda else "cpu_time_total"
    lines += ["", "torch.profiler key_averages:", prof.key_averages().table(sort_by=sort_key, row_limit=30,
                                                                           max_name_column_width=70)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return {"file": str(path), "step_wall_ms": round(wall_ms, 3), "step_tokens": step_tokens,
            "kernel_count": len(kernels), "kernel_time_us": round(total_us, 1),
            "top_kernels": [{"name": n[:120], "us": round(sum(v), 1), "calls": len(v)} for n, v in ranked[:10]]}


def profile_every_rank(engine, path: Path) -> dict:
    """One engine step profiled on every tensor-parallel rank at once (`LLMEngine.start_profile`),
    to tell an all-reduce's own time from a rank's wait for its peer. Both ranks leave a
    collective together, so a pair of the same all-reduce on two ranks ends at about the same
    moment: the rank that started later spent only the op's own time in it (the shorter
    duration), the other waited the rest at the entry. Pairs are found by overlap in time
    (the traces share the host's clock); the ends' spread is reported as the clock's check.
    The summary is written to `path` (JSON)."""
    engine.start_profile()
    engine.step()
    traces = engine.stop_profile()
    kernels = [_trace_kernels(trace) for trace in traces]
    reduces = [[k for k in rank if _is_all_reduce(k[0])] for rank in kernels]
    summary = {
        "traces": traces,
        "ranks": [{"kernels": len(k), "kernel_ms": round(sum(d for _, _, d in k) / 1e3, 2),
                   "all_reduces": len(r), "all_reduce_ms": round(sum(d for _, _, d in r) / 1e3, 2),
                   "all_reduce_median_us": round(_median([d for _, _, d in r]), 1), **_idle_between_kernels(k)}
                  for k, r in zip(kernels, reduces)],
        **all_reduce_waits(reduces[0], reduces[1])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def all_reduce_waits(rank0: list[tuple[str, float, float]], rank1: list[tuple[str, float, float]]) -> dict:
    """Two ranks' all-reduce kernels (name, start us, duration us), each sorted by start:
    those that overlap in time are one collective; the shorter duration of a pair is the op's
    own time, the rest of the longer one a wait for the peer."""
    pairs = _overlapping_pairs(rank0, rank1)
    own = [min(a[2], b[2]) for a, b in pairs]
    waits = [(a[2] - o, b[2] - o) for (a, b), o in zip(pairs, own)]
    end_spread = [abs((a[1] + a[2]) - (b[1] + b[2])) for a, b in pairs]
    return {"paired_all_reduces": len(pairs),
            "own_time_ms": round(sum(own) / 1e3, 3), "own_time_median_us": round(_median(own), 1),
            "rank0_waited_ms": round(sum(w0 for w0, _ in waits) / 1e3, 3),
            "rank1_waited_ms": round(sum(w1 for _, w1 in waits) / 1e3, 3),
            "rank0_waited_in": sum(w0 > w1 for w0, w1 in waits),
            "end_spread_median_us": round(_median(end_spread), 2)}


def _idle_between_kernels(kernels: list[tuple[str, float, float]], top: int = 8) -> dict:
    """A rank's GPU idle time (`gpu_idle_gaps` over its kernels) and its largest holes, each
    with the kernels before and after it (where the rank waits)."""
    _, gaps, _ = gpu_idle_gaps([(start, start + dur) for _, start, dur in kernels], [], IDLE_GAP_US)
    ending_at = {start + dur: name for name, start, dur in kernels}
    starting_at = {start: name for name, start, _ in kernels}
    largest = sorted(gaps, key=lambda gap: gap[0] - gap[1])[:top]
    return {"idle_ms": round(sum(end - begin for begin, end in gaps) / 1e3, 2), "idle_holes": len(gaps),
            "largest_holes": [{"us": round(end - begin, 1), "after": ending_at[begin][:60], "before": starting_at[end][:60]}
                              for begin, end in largest]}


def _trace_kernels(trace: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel in a Chrome trace, by start."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return sorted(((e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel"),
                  key=lambda k: k[1])


def _is_all_reduce(name: str) -> bool:
    """Symmetric memory's `two_shot_all_reduce_kernel`, NCCL's `ncclDevKernel_AllReduce...`."""
    return "allreduce" in name.lower().replace("_", "")


def _overlapping_pairs(a: list, b: list) -> list[tuple]:
    """Kernels of two ranks, each sorted by start, paired when their intervals overlap."""
    pairs, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        (_, a_start, a_dur), (_, b_start, b_dur) = a[i], b[j]
        if max(a_start, b_start) < min(a_start + a_dur, b_start + b_dur):
            pairs.append((a[i], b[j]))
            i, j = i + 1, j + 1
        elif a_start + a_dur <= b_start:
            i += 1
        else:
            j += 1
    return pairs


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--batch1", action="store_true",
                        help="issue 15: batch-1 decode step, TPOT through LLM.generate and a one-step profile, "
                             "with LLM() defaults")
    parser.add_argument("--full-batch", action="store_true",
                        help="issue 15: the headline's 256-request batch at temperature 0.6, LLM() defaults: "
                             "decode step time and a one-step profile")
    parser.add_argument("--smoke", action="store_true", help="with --batch1 / --full-batch: tiny, fp32 (CPU)")
    args = parser.parse_args()
    for wanted, measure_fn, profile_name in ((args.full_batch, full_batch, "profile_full_batch_decode_step.txt"),
                                             (args.batch1, batch1, "profile_batch1_decode_step.txt")):
        if wanted:
            profile_path = Path(args.profile_dir) / profile_name if args.profile_dir else None
            report = measure_fn(args.ckpt, profile_path, smoke=args.smoke)
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
