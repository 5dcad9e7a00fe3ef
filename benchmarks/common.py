"""What every benchmark script shares: nano-vllm's workload, its checkpoints, timing, profiles, results.

The scripts beside this module each measure one thing and import only this module (and
`tensor_parallel.py` reuses `decode_latency.full_batch`, `nano_vllm_workload.py` the Triton build
timer of `startup.py`, which keeps it there to import no torch before its clock). Sections:

    workload      nano-vllm's bench.py draw (256 requests, seed 0) and its engine arguments
    checkpoints   random-weight bf16 models of benchmarks/configs, with a stand-in tokenizer
    checking      every request must get exactly its max_tokens; environment and run metadata
    loggers       engine stat loggers: progress, the step timeline of a whole run
    transformers  the peer: transformers' continuous batching on the same requests
    timing        CUDA-event medians; Triton's on-disk cache (which kernels a run compiled)
    profiles      torch.profiler / cProfile of one engine step, the GPU's idle time, TP ranks
    results       where a run's JSON goes: benchmarks/results/<benchmark>_<gpu>.json
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import time
from typing import Callable
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
RESULTS_DIR = Path(__file__).parent / "results"

# --------------------------------------------------------------------------- workload
# nano-vllm's workload (bench.py).
NUM_SEQS, MIN_LEN, MAX_INPUT_LEN, MAX_OUTPUT_LEN, MAX_TOKEN_ID, SEED = 256, 100, 1024, 1024, 10000, 0
MAX_MODEL_LEN = MAX_INPUT_LEN + MAX_OUTPUT_LEN  # the longest prompt plus the longest output
# minivllm engine settings of the tuned runs (nano-vllm uses the same token budget per step).
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, GPU_MEMORY_UTILIZATION = 256, 16384, 0.9
PAD_TOKEN_ID = 0  # any id: padded positions are masked out
WARMUP_TOKENS, WARMUP_REQUESTS = 24, 32


# nano-vllm's bench.py, exactly: LLM(path, enforce_eager=False, max_model_len=4096), then
# `llm.generate(["Benchmark: "], SamplingParams())` as warm-up. nano-vllm's SamplingParams()
# is temperature 1.0, max_tokens 64; minivllm's (vLLM's) default max_tokens is 16, so we pass 64.
NANO_MAX_MODEL_LEN = 4096
NANO_WARMUP_PROMPT, NANO_WARMUP_PARAMS = "Benchmark: ", {"temperature": 1.0, "max_tokens": 64}


def make_workload(num_seqs: int = NUM_SEQS, seed: int = SEED) -> tuple[list[list[int]], list[int]]:
    """(prompt_token_ids, max_tokens) exactly as nano-vllm's bench.py draws them."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(MIN_LEN, MAX_INPUT_LEN))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(MIN_LEN, MAX_OUTPUT_LEN) for _ in range(num_seqs)]
    return prompts, max_tokens


def row_workload(spec: dict) -> tuple[list[list[int]], list[int]]:
    """The workload of one row: nano-vllm's, or its first `num_seqs` requests; the CPU smoke test
    cuts prompts to `prompt_cap` and outputs to `max_tokens_cap` tokens."""
    prompts, max_tokens = make_workload(NUM_SEQS)
    n = spec.get("num_seqs", NUM_SEQS)
    prompts, max_tokens = prompts[:n], max_tokens[:n]
    if spec.get("prompt_cap"):
        prompts = [p[:spec["prompt_cap"]] for p in prompts]
    if spec.get("max_tokens_cap"):
        max_tokens = [min(m, spec["max_tokens_cap"]) for m in max_tokens]
    return prompts, max_tokens


def engine_args_used(given: dict) -> dict:
    """Every EngineArgs field (the given ones and the defaults), as JSON scalars."""
    import dataclasses

    from minivllm.engine.arg_utils import EngineArgs

    args = dataclasses.asdict(EngineArgs(**given))
    return {k: v for k, v in args.items() if v is None or isinstance(v, (bool, int, float, str))}


def resolved_engine_settings(engine) -> dict:
    """What the engine made of its arguments (defaults filled in, KV blocks counted)."""
    sc, cc = engine.scheduler_config, engine.cache_config
    return {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
            "max_model_len": sc.max_model_len, "num_scheduler_steps": sc.num_scheduler_steps,
            "enable_chunked_prefill": sc.enable_chunked_prefill, "block_size": cc.block_size,
            "num_gpu_blocks": cc.num_gpu_blocks, "enable_prefix_caching": cc.enable_prefix_caching,
            "dtype": str(engine.model_config.dtype).removeprefix("torch.")}


# --------------------------------------------------------------------------- checkpoints
def build_checkpoint(name: str, out_dir: Path, device: str, overrides: dict | None = None) -> Path:
    """Random-weight bf16 checkpoint of benchmarks/configs/<name>, plus a stand-in tokenizer.

    The tokenizer only exists because the engine loads one; the benchmark sends token ids
    and never detokenizes. `overrides` shrinks the config (CPU smoke tests).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(CONFIG_DIR / name, **(overrides or {}))
    if getattr(config, "layer_types", None) is not None:  # Qwen3: one entry per layer
        config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    torch.manual_seed(SEED)
    with torch.device(device):  # initialising 600M parameters is much faster on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = out_dir / name
    model.save_pretrained(path)
    _save_stand_in_tokenizer(path, config.vocab_size, config.eos_token_id)
    del model
    return path


def _save_stand_in_tokenizer(path: Path, vocab_size: int, eos_token_id) -> None:
    """One word per token id ("t0" .. "t<vocab_size - 1>"), the model's EOS id as EOS.

    Every id decodes to a word, so a server that detokenizes (benchmarks/serving.py) streams
    a non-empty text per token, as it would with a real tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos_id = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    eos_id = eos_id if eos_id is not None and eos_id < vocab_size else 1
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",
                            eos_token=f"t{eos_id}").save_pretrained(path)


# --------------------------------------------------------------------------- checking
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def checked_result(token_ids: list[list[int]], max_tokens: list[int], elapsed: float) -> dict:
    """Throughput, after checking that each request got exactly its max_tokens tokens."""
    counts = [len(t) for t in token_ids]
    wrong = [i for i, (c, m) in enumerate(zip(counts, max_tokens)) if c != m]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests got the wrong number of tokens, e.g. #{wrong[0]}: "
                           f"{counts[wrong[0]]} instead of {max_tokens[wrong[0]]}.")
    output_tokens = sum(counts)
    return {"num_requests": len(token_ids), "output_tokens": output_tokens, "tokens_checked": True,
            "elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(output_tokens / elapsed, 1)}


def environment(device: str) -> dict:
    """What a result was measured on and with: GPU, library versions, commit and date."""
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"], env["gpu_count"] = torch.cuda.get_device_name(), torch.cuda.device_count()
        env.update(_gpu_machine())
    env["cpu"] = _cpu_model()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def _gpu_machine() -> dict:
    """The driver, and what else computes on the GPUs: two machines of one kind may differ in
    these, and a batch-1 step can differ with them."""
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    apps = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    try:
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.split()
        pids = subprocess.run(apps, capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"driver": driver[0] if driver else None,
            "other_gpu_processes": len([pid for pid in pids if pid != str(os.getpid())])}


@contextlib.contextmanager
def gpu_clocks(device: str, every_ms: int = 250):
    """While the block runs, nvidia-smi samples the GPU's SM clock, power and temperature every
    `every_ms`; at its end the yielded dict holds their summary (empty without a CUDA GPU or
    nvidia-smi). Two runs of one workload on one kind of GPU can differ by a sixth; a GPU
    that clocks down (its power cap, its heat, a neighbour's) shows here."""
    summary: dict = {}
    if not device.startswith("cuda") or not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        yield summary
        return
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             f"--loop-ms={every_ms}", f"--id={_nvidia_smi_id(torch.device(device))}"]
    sampler = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield summary
    finally:
        sampler.terminate()
        try:
            out, _ = sampler.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            sampler.kill()
            out, _ = sampler.communicate()
        summary.update(clock_summary(out))


def _nvidia_smi_id(device: torch.device) -> str:
    """The GPU as nvidia-smi names it: by UUID, which CUDA_VISIBLE_DEVICES does not renumber."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    if not uuid:
        return str(index)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def clock_summary(csv_lines: str) -> dict:
    """nvidia-smi's "clock MHz, power W, temperature C" lines -> min and median clock, peak power
    and temperature. Lines that are not three numbers ("[N/A]", a line cut short) are skipped."""
    samples = []
    for line in csv_lines.splitlines():
        try:
            sm_mhz, watts, celsius = (float(field) for field in line.split(","))
        except ValueError:
            continue
        samples.append((sm_mhz, watts, celsius))
    if not samples:
        return {}
    clocks = [sample[0] for sample in samples]
    return {"samples": len(samples), "sm_mhz_min": min(clocks), "sm_mhz_median": statistics.median(clocks),
            "power_w_max": max(sample[1] for sample in samples),
            "temperature_c_max": max(sample[2] for sample in samples)}


def _cpu_model() -> str:
    """The host CPU (the host's share of a step depends on it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def commit() -> str:
    """$MINIVLLM_COMMIT where set (a copy of the tree whose .git is missing or not its own),
    else the checkout's commit (short hash)."""
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    return out.stdout.strip() if out is not None and out.returncode == 0 else "unknown"


# --------------------------------------------------------------------------- loggers
class ProgressLogger:
    """Engine stat logger: output tokens so far, written to `path` every PROGRESS_EVERY_S
    seconds, so a row that runs out of time still says how far it got (one int per step)."""

    def __init__(self, path: Path) -> None:
        self.path, self.tokens = path, 0
        self.start = self.last_write = time.monotonic()

    def log(self, stats) -> None:
        self.tokens += stats.num_generation_tokens_iter  # (as the engine counts them; indicative only)
        if stats.now - self.last_write >= PROGRESS_EVERY_S:
            self.last_write = stats.now
            self.path.write_text(json.dumps({"output_tokens_so_far": self.tokens,
                                             "seconds_so_far": round(stats.now - self.start, 2)}))


PROGRESS_EVERY_S = 2.0


def running_context_tokens(engine) -> int:
    """Tokens of KV the engine's running sequences hold (prompt plus output so far)."""
    return sum(seq.get_len() for group in engine.scheduler.running for seq in group.get_seqs() if not seq.is_finished())


class StepTimeline:
    """Engine stat logger: where a whole run's wall time goes, step by step.

    Each `step()` is one record: its wall time (from the previous step's end), the prompt
    and output tokens it produced, and how many requests were running when it began. The
    summary splits the run into prefill steps and decode steps bucketed by batch size, so
    the full batch's rate, the ramp-down as requests finish, and the prefills each get
    their seconds and tokens: the profile of a whole benchmark run, not of one step.
    """

    BUCKETS = ((224, "decode, 224-256 running"), (128, "decode, 128-223 running"), (32, "decode, 32-127 running"),
               (8, "decode, 8-31 running"), (1, "decode, 1-7 running"))

    def __init__(self, context_tokens: Callable[[], int] | None = None, builds: list | None = None) -> None:
        # context_tokens(): the summed lengths of the running sequences, read after each step,
        # so each record knows how much KV its decode steps read (benchmarks/roofline.py).
        self.context_tokens = context_tokens or (lambda: 0)
        # builds: a `startup.TritonBuildTimer`'s list, (kernel, start, seconds) per Triton build,
        # so a stalled step says which kernels it compiled or loaded.
        self.builds, self.builds_seen = builds, len(builds or ())
        self.last, self.running, self.context, self.steps = time.monotonic(), 0, 0, []
        self.stalls: list[dict] = []  # steps that took over STALL_FACTOR x the previous one
        self.allocator_events = _allocator_events()
        self.gc_s = self.gc_started = self.gc_at_last_step = 0.0  # time in Python's garbage collector
        self.gc_full = self.gc_full_at_last_step = 0  # full collections
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_started = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self.gc_started
            self.gc_full += info["generation"] == 2

    def log(self, stats) -> None:
        seconds = stats.now - self.last
        events = _allocator_events()
        if self.steps and seconds > self.STALL_FACTOR * self.steps[-1][0] and seconds > self.STALL_MIN_S:
            # What the CUDA caching allocator did in the step: a retry frees every cached
            # block and synchronizes the device (a memory-pressure stall, not the engine).
            self.stalls.append({"step": len(self.steps), "ms": round(1e3 * seconds, 1), "running": self.running,
                                "gc_ms": round(1e3 * (self.gc_s - self.gc_at_last_step), 1),
                                "gc_full_collections": self.gc_full - self.gc_full_at_last_step,
                                **{k: events[k] - self.allocator_events[k] for k in events},
                                **self._builds_since_last_step()})
        self.builds_seen = len(self.builds or ())
        self.allocator_events, self.gc_at_last_step, self.gc_full_at_last_step = events, self.gc_s, self.gc_full
        self.steps.append((seconds, stats.num_prompt_tokens_iter, stats.num_generation_tokens_iter, self.running,
                           self.context))
        self.last, self.running, self.context = stats.now, stats.num_running_sys, self.context_tokens()

    STALL_FACTOR, STALL_MIN_S = 2.0, 0.1

    def _builds_since_last_step(self) -> dict:
        """{"triton_builds": [[kernel, ms], ...]} of the builds in the step just ended ({} without a timer)."""
        if self.builds is None:
            return {}
        return {"triton_builds": [[name, round(1e3 * seconds, 1)] for name, _, seconds in self.builds[self.builds_seen:]]}

    def phase(self, prompt_tokens: int, running_before: int) -> str:
        if prompt_tokens:
            return "prefill steps"
        return next(label for floor, label in self.BUCKETS if running_before >= floor)

    def summary(self) -> dict:
        """{phase: {"steps", "seconds", "share_of_time", "output_tokens", "share_of_tokens", "output_tok_s"}}."""
        phases: dict[str, list] = {}
        for seconds, prompt_tokens, output_tokens, running, context in self.steps:
            totals = phases.setdefault(self.phase(prompt_tokens, running), [0, 0.0, 0, 0, 0, 0.0])
            totals[0] += 1
            totals[1] += seconds
            totals[2] += output_tokens
            totals[3] += prompt_tokens
            if not prompt_tokens and running:  # each new token attends to its sequence's context
                totals[4] += round(output_tokens * context / running)
            # Forward passes: a decode step runs output_tokens / running of them (multi-step).
            totals[5] += output_tokens / running if not prompt_tokens and running else 1
        all_s = sum(t[1] for t in phases.values()) or 1.0
        all_tokens = sum(t[2] for t in phases.values()) or 1
        order = ["prefill steps"] + [label for _, label in self.BUCKETS]
        summary = {name: {"steps": t[0], "seconds": round(t[1], 3), "share_of_time": round(t[1] / all_s, 3),
                          "output_tokens": t[2], "share_of_tokens": round(t[2] / all_tokens, 3),
                          "prompt_tokens": t[3], "output_tok_s": round(t[2] / t[1], 1) if t[1] else None,
                          "kv_token_reads": t[4], "forward_passes": round(t[5])}
                   for name, t in sorted(phases.items(), key=lambda kv: order.index(kv[0]))}
        for phase in summary.values():  # the first steps one by one: a compile or a stall stands out
            phase["first_steps_ms"] = []
        for seconds, prompt_tokens, _, running, _ in self.steps:
            listed = summary[self.phase(prompt_tokens, running)]["first_steps_ms"]
            if len(listed) < self.FIRST_STEPS_LISTED:
                listed.append(round(1e3 * seconds, 1))
        return summary

    FIRST_STEPS_LISTED = 40


def _allocator_events() -> dict:
    """The CUDA caching allocator's cumulative retries, cudaMalloc and cudaFree calls ({} off a GPU)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "cuda_mallocs": stats.get("num_device_alloc", 0),
            "cuda_frees": stats.get("num_device_free", 0)}


# --------------------------------------------------------------------------- transformers
def load_hf(ckpt: Path, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(device).eval()
    # EOS ignored, as in the workload: generation stops only at max_new_tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def run_hf_cb(ckpt: Path, prompts, max_tokens, device: str, temperature: float = 0.0,
              progress: Path | None = None) -> dict:
    """transformers' continuous batching: a manager thread that schedules requests itself.
    temperature 0 is greedy; above, sampling at that temperature alone (top_k 0, top_p 1)."""
    from transformers import GenerationConfig

    model = load_hf(ckpt, device)
    if not hasattr(model, "init_continuous_batching"):
        return {"error": "this transformers has no init_continuous_batching"}
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    config = GenerationConfig(**sampling, max_new_tokens=max(max_tokens), eos_token_id=-1,
                              pad_token_id=PAD_TOKEN_ID)
    manager = model.init_continuous_batching(generation_config=config)
    per_request = "max_new_tokens" in inspect.signature(manager.add_request).parameters
    manager.start()
    try:
        _hf_cb_collect(manager, prompts[:2], [WARMUP_TOKENS] * 2, per_request, "warmup")
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            token_ids = _hf_cb_collect(manager, prompts, max_tokens, per_request, "req", progress)
        sync(device)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    if not per_request:  # every request ran to the longest max_tokens; count only what was asked
        token_ids = [t[:m] for t, m in zip(token_ids, max_tokens)]
    result = checked_result(token_ids, max_tokens, elapsed)
    result.update(per_request_max_new_tokens=per_request,
                  attn_implementation=getattr(model.config, "_attn_implementation", None))
    result["first_outputs"] = [t[:16] for t in token_ids[:8]]
    return result


def _hf_cb_collect(manager, prompts, max_tokens, per_request: bool, prefix: str,
                   progress: Path | None = None) -> list[list[int]]:
    """Add every request, wait for all; `progress` gets the finished requests' tokens so far."""
    ids, start, finished_tokens = [], time.monotonic(), 0
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        kwargs = {"max_new_tokens": m} if per_request else {}
        ids.append(manager.add_request(input_ids=prompt, request_id=f"{prefix}{i}", **kwargs))
    results = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early.")
            continue
        if out.request_id in ids:
            results[out.request_id] = list(out.generated_tokens)
            finished_tokens += min(len(out.generated_tokens), max_tokens[ids.index(out.request_id)])
            if progress is not None:
                progress.write_text(json.dumps({"output_tokens_so_far": finished_tokens, "finished_requests_only": True,
                                                "seconds_so_far": round(time.monotonic() - start, 2)}))
    return [results[i] for i in ids]


# --------------------------------------------------------------------------- timing
def cuda_median_ms(fn, reps: int) -> float:
    if not torch.cuda.is_available():  # CPU smoke tests
        return median_wall_ms(fn, reps)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def median_wall_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def triton_cache_entries() -> list[Path]:
    """Compiled kernels in Triton's on-disk cache (one folder each)."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return [entry for entry in cache.iterdir() if entry.is_dir()] if cache.is_dir() else []


def kernel_name(entry: Path) -> str:
    """The kernel a cache folder holds (its files are named after it)."""
    names = sorted({f.name.split(".")[0] for f in entry.iterdir() if f.suffix == ".json"} - {"__grp__"})
    return ",".join(name.removeprefix("__grp__") for name in names) or entry.name


# --------------------------------------------------------------------------- profiles
TOP_KERNELS = 25  # kernels listed in a one-step profile
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
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
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
    reduces = [[k for k in rank if is_all_reduce(k[0])] for rank in kernels]
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
    own time, the rest of the longer one a wait for the peer. The step's first collective is
    reported apart: its wait is how much later one rank began the step (the engine's message
    reaching a worker, a profiler starting), not a rank falling behind inside it."""
    pairs = _overlapping_pairs(rank0, rank1)
    own = [min(a[2], b[2]) for a, b in pairs]
    waits = [(a[2] - o, b[2] - o) for (a, b), o in zip(pairs, own)]
    end_spread = [abs((a[1] + a[2]) - (b[1] + b[2])) for a, b in pairs]
    first, rest = (waits[0], waits[1:]) if waits else ((0.0, 0.0), [])
    return {"paired_all_reduces": len(pairs),
            "own_time_ms": round(sum(own) / 1e3, 3), "own_time_median_us": round(_median(own), 1),
            "first_rank0_waited_us": round(first[0], 1), "first_rank1_waited_us": round(first[1], 1),
            "rank0_waited_ms": round(sum(w0 for w0, _ in rest) / 1e3, 3),
            "rank1_waited_ms": round(sum(w1 for _, w1 in rest) / 1e3, 3),
            "rank0_waited_in": sum(w0 > w1 for w0, w1 in rest),
            "wait_median_us": round(_median([max(w) for w in rest]), 2),
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


def is_all_reduce(name: str) -> bool:
    """Symmetric memory's `two_shot_all_reduce_kernel`, NCCL's `ncclDevKernel_AllReduce...` and
    minivllm's all-reduce fused with the norm after it (`kernels/custom_all_reduce.py`)."""
    return "allreduce" in name.lower().replace("_", "") or name in ("_one_shot_kernel", "_two_shot_kernel")


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


# --------------------------------------------------------------------------- results
def gpu_tag(gpu: str | None, count: int = 1) -> str:
    """The machine in a result's file name: "NVIDIA H100 80GB HBM3" -> "h100", two H200s ->
    "h200x2", no GPU -> "cpu"."""
    if not gpu:
        return "cpu"
    words = [w for w in gpu.lower().replace("nvidia", " ").split() if any(c.isdigit() for c in w)]
    tag = words[0] if words else gpu.lower().split()[-1]
    return f"{tag}x{count}" if count > 1 else tag


def result_path(benchmark: str, env: dict, out_dir: Path = RESULTS_DIR, suffix: str = ".json") -> Path:
    """OUT_DIR/<benchmark>_<gpu>.json: the latest result of one benchmark on one machine kind."""
    return Path(out_dir) / f"{benchmark}_{gpu_tag(env.get('gpu'), env.get('gpu_count', 1))}{suffix}"
