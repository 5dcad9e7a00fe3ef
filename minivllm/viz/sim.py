"""A model-free simulator: the real `LLMEngine`, a stand-in model that returns scripted tokens.

`Simulator` drives the engine exactly as a server would (add, abort, step) through
`ScriptedExecutor`, an executor whose "model" emits, for each sequence, tokens up to a
target length and then `EOS_TOKEN_ID`. The engine runs tokenizer-free (`skip_tokenizer_init`)
on a model config built in code, so nothing is read from disk. The scheduler, the block
manager, forks, stop rules, every queue, preemption and swap are the engine's own, and a
whole workload runs in milliseconds; a `SnapshotRecorder` records every step.

    requests = make_workload(num_requests=20, prompt_len=(8, 64), output_len=(4, 64), seed=0)
    result = Simulator(SchedulerConfig(...), CacheConfig(..., num_gpu_blocks=64)).run(requests)
    result.snapshots[3].running        # queue view at step 3
    result.results["7"].ttft_steps     # steps from arrival to the first token
    result.stats.slot_utilization

What this module keeps for itself: workloads (`SimRequest`, `make_workload`), time
(`StepCostModel`: a linear model of one step's cost: fixed overhead + per-token compute +
swap traffic), the per-request results and summaries, and `simulate_static_batching`, the
baseline continuous batching replaced: fixed batches, each padded until its longest request
finishes.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from minivllm.core.scheduler import SchedulerOutputs
from minivllm.engine.llm_engine import LLMEngine, StepObserver
from minivllm.engine.selector import engine_class
from minivllm.executor.executor_base import ExecutorBase
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import (ExecuteModelRequest, SamplerOutput, SequenceGroup, SequenceGroupMetadata,
                               SequenceGroupOutput, SequenceOutput, SequenceStatus)
from minivllm.viz.snapshot import BatchEntry, SnapshotRecorder, StepSnapshot

EOS_TOKEN_ID = 0
# Token ids the stand-in model and `make_workload` draw from (EOS excluded).
VOCAB_SIZE = 1000
# What the engine accepts in a prompt: there are no embeddings to index, so any id a
# workload brings (a benchmark's, drawn from a real model's vocabulary) is fine.
PROMPT_VOCAB_SIZE = 1 << 30
DEFAULT_MAX_STEPS = 100_000


@dataclass
class SimRequest:
    """One request of a workload.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt (never empty).
        output_lens: target output length of each sequence (len = n); the stand-in model
            emits EOS as token number `output_lens[i]` of sequence i.
        arrival_step: step at which the request is added.
        priority: lower runs first under policy="priority".
        max_tokens: SamplingParams.max_tokens (None: only EOS or max_model_len stop it).
        abort_step: if set, the request is aborted at the start of that step.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_lens: list[int]
    arrival_step: int = 0
    priority: int = 0
    max_tokens: int | None = None
    abort_step: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt must not be empty.")
        if not self.output_lens or min(self.output_lens) < 1:
            raise ValueError(f"request {self.request_id}: output_lens must be >= 1, got {self.output_lens}.")
        if self.arrival_step < 0:
            raise ValueError(f"request {self.request_id}: arrival_step must be >= 0.")

    @property
    def n(self) -> int:
        return len(self.output_lens)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(num_requests: int, prompt_len: int | tuple[int, int] = (8, 64),
                  output_len: int | tuple[int, int] = (4, 64), arrival_every: float = 0.0,
                  n: int = 1, shared_prefix_len: int = 0, seed: int = 0) -> list[SimRequest]:
    """Random requests: lengths uniform in the given [low, high] ranges.

    `arrival_every` is the mean number of steps between arrivals (exponential gaps,
    0 = all arrive at step 0). `shared_prefix_len` tokens open every prompt (a system
    prompt, for prefix caching).
    """
    if num_requests < 0 or arrival_every < 0 or n < 1 or shared_prefix_len < 0:
        raise ValueError("num_requests, arrival_every and shared_prefix_len must be >= 0, n >= 1.")
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB_SIZE) for _ in range(shared_prefix_len)]
    requests, clock = [], 0.0
    for i in range(num_requests):
        body = [rng.randrange(1, VOCAB_SIZE) for _ in range(_draw(rng, prompt_len))]
        outputs = [_draw(rng, output_len) for _ in range(n)]
        requests.append(SimRequest(str(i), prefix + body, outputs, arrival_step=int(clock)))
        if arrival_every > 0:
            clock += rng.expovariate(1.0 / arrival_every)
    return requests


def _draw(rng: random.Random, value: int | tuple[int, int]) -> int:
    return rng.randint(*value) if isinstance(value, tuple) else value


@dataclass
class StepCostModel:
    """Milliseconds one step takes: a linear model, good enough to compare schedules.

    step_ms = step_overhead_ms + ms_per_token * num_batched_tokens
              + swapped blocks * (ms_per_swap_transfer + ms_per_swapped_token * block_size)
    The overhead is the memory-bound part (weights read once per step), the per-token
    term the compute-bound part (prefill); each swapped block pays a fixed transfer cost
    plus its bytes over PCIe, which makes small blocks expensive to swap.
    """

    step_overhead_ms: float = 10.0
    ms_per_token: float = 0.1
    ms_per_swap_transfer: float = 0.05
    ms_per_swapped_token: float = 0.01

    def step_ms(self, num_batched_tokens: int, num_swapped_blocks: int, block_size: int) -> float:
        swap = num_swapped_blocks * (self.ms_per_swap_transfer + self.ms_per_swapped_token * block_size)
        return self.step_overhead_ms + self.ms_per_token * num_batched_tokens + swap


@dataclass
class RequestResult:
    """How one request went. Step counts include the step itself (TTFT 1 = first step)."""

    request_id: str
    arrival_step: int
    n: int = 1
    finish_reason: str | None = None  # "stop", "length", "abort"
    status: str | None = None  # SequenceStatus name: aborted > ignored > the first sequence's
    finish_message: str | None = None
    seq_statuses: list[str] = field(default_factory=list)  # per sequence, in fork order
    seq_output_lens: list[int] = field(default_factory=list)
    first_token_step: int | None = None
    finish_step: int | None = None
    token_steps: list[int] = field(default_factory=list)  # steps in which it produced tokens
    num_output_tokens: int = 0
    num_preemptions: int = 0
    arrival_ms: float = 0.0
    first_token_ms: float | None = None
    finish_ms: float | None = None

    @property
    def ttft_steps(self) -> int | None:
        return None if self.first_token_step is None else self.first_token_step - self.arrival_step + 1

    @property
    def latency_steps(self) -> int | None:
        return None if self.finish_step is None else self.finish_step - self.arrival_step + 1

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ms is None else self.first_token_ms - self.arrival_ms

    @property
    def latency_ms(self) -> float | None:
        return None if self.finish_ms is None else self.finish_ms - self.arrival_ms


@dataclass
class SimStats:
    """Summary of a run. Slot utilization: scheduled sequences / (max_num_seqs x steps)."""

    num_steps: int
    num_generated_tokens: int
    throughput: float  # generated tokens per step
    slot_utilization: float
    total_ms: float
    num_preemptions: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    mean_ttft_ms: float
    mean_itl_ms: float  # mean time between two tokens of one sequence, after the first


@dataclass
class SimResult:
    snapshots: list[StepSnapshot]
    results: dict[str, RequestResult]
    stats: SimStats

    def token_times_ms(self, request_id: str) -> list[float]:
        """When each of the request's tokens was ready (end of the step that made it)."""
        return [self.snapshots[step].time for step in self.results[request_id].token_steps]

    def max_itl_ms(self, request_id: str) -> float:
        """The longest gap between two consecutive tokens of the request (0 if < 2 tokens)."""
        times = self.token_times_ms(request_id)
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


class ScriptedExecutor(ExecutorBase):
    """The stand-in model: an executor that returns scripted tokens instead of running one.

    For each scheduled group that samples, one token per running sequence: sequence i of a
    request emits `EOS_TOKEN_ID` as its token number `output_lens[i]` (`script`), other
    tokens before it. A prompt of a request with n > 1 gets n samples, so the engine forks
    its siblings as it would after a real prefill (the parent takes the last sample, so
    sibling i is the group's sequence i). A sibling's first token encodes i, which is how a
    later step knows which length it has (sequence ids are the engine's business).
    The pools have the sizes `cache_config` names; nothing is allocated.
    """

    def _init_executor(self) -> None:
        self._output_lens: dict[str, list[int]] = {}

    def script(self, request_id: str, output_lens: list[int]) -> None:
        """Sequence i of `request_id` will produce `output_lens[i]` tokens, the last one EOS."""
        self._output_lens[request_id] = list(output_lens)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        cache_config = self.engine_config.cache_config
        return cache_config.num_gpu_blocks, cache_config.num_cpu_blocks or 0

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """No KV cache to allocate: no model reads it."""

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        # One step, even when a multi-step run was offered: the engine accepts fewer.
        return [SamplerOutput([self._samples(m) for m in execute_model_req.seq_group_metadata_list])]

    def _samples(self, metadata: SequenceGroupMetadata) -> SequenceGroupOutput:
        if not metadata.do_sample:  # a prompt chunk short of the end: no token yet
            return SequenceGroupOutput(samples=[])
        rid, n = metadata.request_id, metadata.sampling_params.n
        samples = []
        for seq_id, data in metadata.seq_data.items():
            if n > 1 and not data.output_token_ids:  # the prompt is done: fork the siblings
                indices = [*range(1, n), 0]  # the parent (sibling 0) keeps the last sample
            else:
                indices = [self._sibling_index(rid, data.output_token_ids)]
            for index in indices:
                token = self._next_token(rid, index, data.get_output_len() + 1)
                samples.append(SequenceOutput(seq_id, token, {token: 0.0}))
        return SequenceGroupOutput(samples=samples)

    def _next_token(self, request_id: str, index: int, num_output: int) -> int:
        if num_output >= self._output_lens[request_id][index]:
            return EOS_TOKEN_ID
        step = index if num_output == 1 else index * 31 + num_output * 7
        return 1 + (_request_base(request_id) + step) % (VOCAB_SIZE - 1)

    @staticmethod
    def _sibling_index(request_id: str, output_token_ids: list[int]) -> int:
        if not output_token_ids:
            return 0
        return (output_token_ids[0] - 1 - _request_base(request_id)) % (VOCAB_SIZE - 1)


def _request_base(request_id: str) -> int:
    # crc32, not hash(): str hashes are salted per process, and runs must repeat exactly.
    return zlib.crc32(request_id.encode()) % (VOCAB_SIZE - 1)


def sim_engine_config(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> EngineConfig:
    """An `EngineConfig` that needs nothing from disk: a tiny Llama shape built in code (its
    vocabulary and context length are all the engine reads) and no tokenizer."""
    from transformers import LlamaConfig  # deferred: slow to import, only needed here

    hf_config = LlamaConfig(vocab_size=PROMPT_VOCAB_SIZE, hidden_size=8, intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=1,
                            max_position_embeddings=scheduler_config.max_model_len,
                            eos_token_id=EOS_TOKEN_ID, bos_token_id=None, pad_token_id=None)
    model_config = ModelConfig(skip_tokenizer_init=True, hf_config=hf_config,
                               max_model_len=scheduler_config.max_model_len)
    return EngineConfig(model_config, cache_config, scheduler_config, DeviceConfig("cpu"))


class Simulator(StepObserver):
    """Runs a workload through the real `LLMEngine` with the scripted stand-in model.

    The engine's scheduler, block manager, output processor (forks, stop rules) and abort
    path all run as they do with a model; only `ScriptedExecutor` replaces the model. A
    `SnapshotRecorder` records every step; this class adds the workload's arrivals and
    aborts, the cost model's clock and the per-request results.

    Args:
        scheduler_config, cache_config: as for the engine; `cache_config.num_gpu_blocks`
            (and `num_cpu_blocks` for swapping) must be set, since no profile run sizes them.
        cost_model: how long each step takes (milliseconds).
        include_block_manager: store the block manager's state in every snapshot.
        max_steps: a safety limit (RuntimeError if a run has not finished by then).

    A request's `priority` is passed to the engine only under policy "priority" (FCFS ignores
    it; the engine refuses a priority it would ignore).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_model: StepCostModel | None = None, include_block_manager: bool = False,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set: no profile run sizes a simulation.")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.cost_model = cost_model or StepCostModel()
        self.max_steps = max_steps
        self.current_step = 0
        self.now_ms = 0.0
        self._step_start_ms = 0.0
        engine_config = sim_engine_config(scheduler_config, cache_config)
        self.engine = engine_class(engine_config)(engine_config, executor_class=ScriptedExecutor)
        self.engine.add_step_observer(self)  # advances the clock before the recorder stamps it
        self.recorder = SnapshotRecorder(self.engine, include_block_manager=include_block_manager,
                                         clock=lambda: self.now_ms)
        self._groups: dict[str, SequenceGroup] = {}
        self.results: dict[str, RequestResult] = {}

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def snapshots(self) -> list[StepSnapshot]:
        return self.recorder.snapshots

    def run(self, requests: list[SimRequest]) -> SimResult:
        """Run until every request has finished; returns snapshots, per-request results, stats."""
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique.")
        pending = sorted(requests, key=lambda r: r.arrival_step)
        aborts = {r.request_id: r.abort_step for r in requests if r.abort_step is not None}
        while pending or self.engine.has_unfinished_requests():
            if self.current_step >= self.max_steps:
                raise RuntimeError(f"simulation did not finish within {self.max_steps} steps.")
            while pending and pending[0].arrival_step <= self.current_step:
                self.add_request(pending.pop(0))
            self.abort([rid for rid, s in aborts.items() if s == self.current_step])
            self.step()
        return self.result()

    def result(self) -> SimResult:
        return SimResult(self.snapshots, self.results, self._stats())

    # ------------------------------------------------------------------ one step
    def step(self) -> StepSnapshot:
        """One engine step; returns its snapshot (recorded in `snapshots`)."""
        output_lens = {rid: _num_output_tokens(g) for rid, g in self._live_groups()}
        self.engine.step()
        snapshot = self.snapshots[-1]
        for request_id in snapshot.ignored:
            self._record_finish(self._groups[request_id], self._step_start_ms)
        for entry in snapshot.batch:
            if _num_output_tokens(self._groups[entry.request_id]) > output_lens[entry.request_id]:
                self._record_token(self.results[entry.request_id])
        for request_id in snapshot.preempted_by_recompute + snapshot.preempted_by_swap:
            self.results[request_id].num_preemptions += 1
        for request_id in snapshot.finished:
            self._record_finish(self._groups[request_id], self.now_ms)
        self.current_step += 1
        return snapshot

    def on_scheduled(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs) -> None:
        """The cost model prices the step as scheduled: its tokens and its swapped blocks."""
        num_swapped = len(scheduler_outputs.blocks_to_swap_in) + len(scheduler_outputs.blocks_to_swap_out)
        self._step_start_ms = self.now_ms
        self.now_ms += self.cost_model.step_ms(scheduler_outputs.num_batched_tokens, num_swapped,
                                               self.cache_config.block_size)

    def _record_token(self, result: RequestResult) -> None:
        result.token_steps.append(self.current_step)
        if result.first_token_step is None:
            result.first_token_step, result.first_token_ms = self.current_step, self.now_ms

    # --------------------------------------------------------------- bookkeeping
    def add_request(self, request: SimRequest) -> None:
        """The request arrives now (at `current_step`), whatever its `arrival_step` says."""
        if request.request_id in self.results:
            raise ValueError(f"request id {request.request_id!r} is already used.")
        self.engine.model_executor.script(request.request_id, request.output_lens)
        priority = request.priority if self.scheduler_config.policy == "priority" else 0
        self.engine.add_request(request.request_id, {"prompt_token_ids": request.prompt_token_ids},
                                SamplingParams(n=request.n, max_tokens=request.max_tokens),
                                arrival_time=self.current_step, priority=priority)
        seq_group = self.engine.scheduler.waiting[-1]  # where add_request queues it
        assert seq_group.request_id == request.request_id
        self._groups[request.request_id] = seq_group
        self.results[request.request_id] = RequestResult(request.request_id, self.current_step, request.n,
                                                         arrival_ms=self.now_ms)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort the requests that have arrived and not finished; returns their ids."""
        live = [rid for rid in request_ids
                if rid in self._groups and self.results[rid].finish_step is None]
        self.engine.abort_request(live)
        for rid in live:
            self._record_finish(self._groups[rid], self.now_ms)
        return live

    def _live_groups(self):
        return ((rid, g) for rid, g in self._groups.items() if self.results[rid].finish_step is None)

    def _record_finish(self, seq_group: SequenceGroup, finish_ms: float) -> None:
        result = self.results[seq_group.request_id]
        statuses = [seq.status for seq in seq_group.get_seqs()]
        status = next((s for s in (SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_IGNORED)
                       if s in statuses), statuses[0])
        result.status = status.name
        result.seq_statuses = [s.name for s in statuses]
        result.seq_output_lens = [seq.get_output_len() for seq in seq_group.get_seqs()]
        result.finish_reason = SequenceStatus.get_finished_reason(status)
        result.finish_message = seq_group.finish_message
        result.finish_step = self.current_step
        result.finish_ms = finish_ms
        result.num_output_tokens = _num_output_tokens(seq_group)

    def _stats(self) -> SimStats:
        return summarize(self.snapshots, self.results, self.scheduler_config.max_num_seqs)


def _num_output_tokens(seq_group: SequenceGroup) -> int:
    return sum(seq.get_output_len() for seq in seq_group.get_seqs())


def summarize(snapshots: list[StepSnapshot], results: dict[str, RequestResult],
              max_num_seqs: int) -> SimStats:
    """Throughput, slot utilization and latency summary of a recorded run."""
    num_steps = len(snapshots)
    generated = sum(r.num_output_tokens for r in results.values())
    used_slots = sum(s.num_scheduled_seqs for s in snapshots)
    ttfts = [r.ttft_ms for r in results.values() if r.ttft_ms is not None]
    itls = [(r.finish_ms - r.first_token_ms) / (r.num_output_tokens / r.n - 1)
            for r in results.values()
            if r.first_token_ms is not None and r.finish_ms is not None
            and r.num_output_tokens > r.n and r.finish_reason != "abort"]
    return SimStats(
        num_steps=num_steps,
        num_generated_tokens=generated,
        throughput=generated / num_steps if num_steps else 0.0,
        slot_utilization=used_slots / (max_num_seqs * num_steps) if num_steps else 0.0,
        total_ms=snapshots[-1].time if snapshots and snapshots[-1].time is not None else 0.0,
        num_preemptions=sum(s.preempted for s in snapshots),
        num_blocks_swapped_out=sum(len(s.blocks_to_swap_out) for s in snapshots),
        num_blocks_swapped_in=sum(len(s.blocks_to_swap_in) for s in snapshots),
        mean_ttft_ms=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        mean_itl_ms=sum(itls) / len(itls) if itls else 0.0,
    )


def simulate_static_batching(requests: list[SimRequest], batch_size: int,
                             cost_model: StepCostModel | None = None) -> SimResult:
    """The baseline: static batching, as before iteration-level scheduling.

    Requests are taken in arrival order, up to `batch_size` of those that have arrived
    when the previous batch ends. A batch runs one prefill step (prompts padded to the
    longest) and then decode steps until its longest request has produced its last token;
    a request that finishes earlier keeps its slot as padding ("idle"), which the GPU still
    computes. Memory is not modelled (static systems reserve the maximum length per slot).
    Generous to the baseline: a request counts as finished at its own last token, not when
    its batch returns. Aborts and n > 1 are not modelled.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    if any(r.n != 1 or r.abort_step is not None for r in requests):
        raise ValueError("static batching models requests with n == 1 and no abort only.")
    cost_model = cost_model or StepCostModel()
    pending = sorted(requests, key=lambda r: r.arrival_step)
    results = {r.request_id: RequestResult(r.request_id, r.arrival_step) for r in requests}
    snapshots: list[StepSnapshot] = []
    while pending:
        step = len(snapshots)
        batch = [r for r in pending if r.arrival_step <= step][:batch_size]
        if not batch:  # nothing has arrived yet: an empty step
            snapshots.append(_static_snapshot(step, [], [], pending, 0, snapshots, cost_model))
            continue
        pending = [r for r in pending if r not in batch]
        _run_static_batch(batch, pending, snapshots, results, cost_model)
    return SimResult(snapshots, results, summarize(snapshots, results, batch_size))


def _run_static_batch(batch: list[SimRequest], pending: list[SimRequest],
                      snapshots: list[StepSnapshot], results: dict[str, RequestResult],
                      cost_model: StepCostModel) -> None:
    lengths = {r.request_id: min(r.output_lens[0], r.max_tokens or r.output_lens[0]) for r in batch}
    max_prompt_len = max(r.prompt_len for r in batch)
    for i in range(max(lengths.values())):
        step = len(snapshots)
        entries = [_static_entry(r, i, lengths[r.request_id]) for r in batch]
        # Padding is computed too: every prompt is as long as the longest, every slot decodes.
        num_tokens = len(batch) * (max_prompt_len if i == 0 else 1)
        finished = [r.request_id for r in batch if i == lengths[r.request_id] - 1]
        snapshot = _static_snapshot(step, entries, finished, pending, num_tokens, snapshots, cost_model)
        snapshots.append(snapshot)
        for r in batch:
            result = results[r.request_id]
            if i == 0:
                result.arrival_ms = _step_start_ms(snapshots, r.arrival_step)
                result.first_token_step, result.first_token_ms = step, snapshot.time
            if r.request_id in finished:
                result.finish_step, result.finish_ms = step, snapshot.time
                result.num_output_tokens = lengths[r.request_id]
                length_capped = r.max_tokens is not None and r.max_tokens < r.output_lens[0]
                status = SequenceStatus.FINISHED_LENGTH_CAPPED if length_capped else SequenceStatus.FINISHED_STOPPED
                result.status, result.finish_reason = status.name, SequenceStatus.get_finished_reason(status)


def _static_entry(request: SimRequest, i: int, length: int) -> BatchEntry:
    if i == 0:
        return BatchEntry(request.request_id, [0], request.prompt_len, "prefill")
    return BatchEntry(request.request_id, [0], 1, "decode" if i < length else "idle")


def _static_snapshot(step: int, entries: list[BatchEntry], finished: list[str],
                     pending: list[SimRequest], num_tokens: int, snapshots: list[StepSnapshot],
                     cost_model: StepCostModel) -> StepSnapshot:
    start_ms = snapshots[-1].time if snapshots else 0.0
    return StepSnapshot(
        step=step, waiting=[r.request_id for r in pending if r.arrival_step <= step],
        running=[e.request_id for e in entries], swapped=[], batch=entries,
        num_batched_tokens=num_tokens, num_gpu_blocks=0, num_cpu_blocks=0,
        num_free_gpu_blocks=0, num_free_cpu_blocks=0, finished=finished,
        time=start_ms + cost_model.step_ms(num_tokens, 0, 1),
    )


def _step_start_ms(snapshots: list[StepSnapshot], step: int) -> float:
    return snapshots[step - 1].time if step > 0 and snapshots[step - 1].time is not None else 0.0
