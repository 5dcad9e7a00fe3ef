"""A model-free simulator: the real Scheduler and BlockSpaceManager, a stand-in model.

The stand-in model does what the engine's model would do to the scheduler's state, and
nothing else: it marks the scheduled tokens as computed and, when a prompt is done or a
decode runs, appends one token per sequence. Each sequence has a target output length;
the model emits `EOS_TOKEN_ID` as its last token. So the scheduler, the block manager and
every queue, preemption and swap are real, and a whole workload runs in milliseconds.

    requests = make_workload(num_requests=20, prompt_len=(8, 64), output_len=(4, 64), seed=0)
    result = Simulator(SchedulerConfig(...), CacheConfig(..., num_gpu_blocks=64)).run(requests)
    result.snapshots[3].running        # queue view at step 3
    result.results["7"].ttft_steps     # steps from arrival to the first token
    result.stats.slot_utilization

Time is counted in steps, and in milliseconds through a `StepCostModel` (a linear model
of one step's cost: fixed overhead + per-token compute + swap traffic). `simulate_static_batching`
is the baseline continuous batching replaced: fixed batches, each padded until its longest
request finishes.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.core.snapshot import BatchEntry, StepSnapshot, take_snapshot
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

EOS_TOKEN_ID = 0
# Token ids the stand-in model and `make_workload` draw from (EOS excluded).
VOCAB_SIZE = 1000
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


class Simulator:
    """Runs a workload through a real `Scheduler` with a stand-in model.

    Args:
        scheduler_config, cache_config: as for the engine; `cache_config.num_gpu_blocks`
            (and `num_cpu_blocks` for swapping) must be set.
        cost_model: converts steps to milliseconds.
        include_block_manager: store the full block-manager state in every snapshot.
        max_steps: safety limit; a run that does not finish raises RuntimeError.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_model: StepCostModel | None = None, include_block_manager: bool = False,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.cost_model = cost_model or StepCostModel()
        self.include_block_manager = include_block_manager
        self.max_steps = max_steps
        self.current_step = 0
        self.now_ms = 0.0
        self.scheduler = Scheduler(scheduler_config, cache_config, clock=lambda: self.current_step)
        self._aborted_before_step: list[str] = []
        self._seq_ids = itertools.count()
        self._targets: dict[int, int] = {}  # seq_id -> target output length
        self._sibling_targets: dict[str, list[int]] = {}  # request_id -> output_lens
        self._done_seqs: set[int] = set()
        self._groups: dict[str, SequenceGroup] = {}
        self.results: dict[str, RequestResult] = {}
        self.snapshots: list[StepSnapshot] = []

    def run(self, requests: list[SimRequest]) -> SimResult:
        """Run until every request has finished; returns snapshots, per-request results, stats."""
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique.")
        pending = sorted(requests, key=lambda r: r.arrival_step)
        aborts = {r.request_id: r.abort_step for r in requests if r.abort_step is not None}
        while pending or self.scheduler.has_unfinished_seqs():
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
        """One scheduler step and one stand-in model step; returns (and records) its snapshot."""
        _, outputs = self.scheduler.schedule()
        snapshot = take_snapshot(self.scheduler, outputs, self.current_step,
                                 include_block_manager=self.include_block_manager)
        snapshot.aborted.extend(self._aborted_before_step)
        self._aborted_before_step = []
        for seq_group in outputs.ignored_seq_groups:
            self._record_finish(seq_group)
        for scheduled in outputs.scheduled_seq_groups:
            self._model_step(scheduled.seq_group, scheduled.token_chunk_size)
        self._advance_clock(outputs)
        for request_id in outputs.preempted_by_recompute + outputs.preempted_by_swap:
            self.results[request_id].num_preemptions += 1
        self._collect_finished(outputs, snapshot)
        snapshot.time = self.now_ms
        self.snapshots.append(snapshot)
        self.current_step += 1
        return snapshot

    def _model_step(self, seq_group: SequenceGroup, token_chunk_size: int) -> None:
        """What the model + sampler + output processor would do to one scheduled group."""
        seq_group.update_num_computed_tokens(token_chunk_size)
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        if any(seq.get_num_uncomputed_tokens() > 0 for seq in seqs):
            return  # a prompt chunk that does not reach the end: no token yet
        if len(seq_group.seqs) == 1 and seq_group.sampling_params.n > 1:
            seqs = self._fork(seq_group)
        for seq in seqs:
            self._append_token(seq_group, seq)
        result = self.results[seq_group.request_id]
        result.token_steps.append(self.current_step)
        if result.first_token_step is None:
            result.first_token_step = self.current_step

    def _fork(self, seq_group: SequenceGroup) -> list[Sequence]:
        """After the first prompt is done, a request with n > 1 forks its siblings."""
        parent = seq_group.first_seq
        for index in range(1, seq_group.sampling_params.n):
            child = parent.fork(next(self._seq_ids))
            seq_group.add(child)
            self.scheduler.fork_seq(parent, child)
            self._targets[child.seq_id] = self._sibling_targets[seq_group.request_id][index]
        return seq_group.get_seqs(status=SequenceStatus.RUNNING)

    def _append_token(self, seq_group: SequenceGroup, seq: Sequence) -> None:
        num_output = seq.get_output_len() + 1
        is_eos = num_output >= self._targets[seq.seq_id]
        token_id = EOS_TOKEN_ID if is_eos else 1 + (seq.seq_id * 31 + num_output) % (VOCAB_SIZE - 1)
        seq.append_token_id(token_id, {token_id: 0.0})
        max_tokens = seq_group.sampling_params.max_tokens
        if is_eos:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif max_tokens is not None and seq.get_output_len() >= max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        elif seq.get_len() >= self.scheduler_config.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _collect_finished(self, outputs: SchedulerOutputs, snapshot: StepSnapshot) -> None:
        for scheduled in outputs.scheduled_seq_groups:
            seq_group = scheduled.seq_group
            snapshot.finished_seq_ids.extend(
                s.seq_id for s in seq_group.get_finished_seqs() if s.seq_id not in self._done_seqs)
            self._done_seqs.update(s.seq_id for s in seq_group.get_finished_seqs())
            if seq_group.is_finished():
                snapshot.finished.append(seq_group.request_id)
                self._record_finish(seq_group)
        self.scheduler.free_finished_seq_groups()

    # --------------------------------------------------------------- bookkeeping
    def add_request(self, request: SimRequest) -> None:
        """The request arrives now (at `current_step`), whatever its `arrival_step` says."""
        if request.request_id in self.results:
            raise ValueError(f"request id {request.request_id!r} is already used.")
        seq = Sequence(next(self._seq_ids), None, request.prompt_token_ids,
                       self.cache_config.block_size, EOS_TOKEN_ID)
        params = SamplingParams(n=request.n, max_tokens=request.max_tokens)
        seq_group = SequenceGroup(request.request_id, [seq], params,
                                  arrival_time=self.current_step, priority=request.priority)
        self._targets[seq.seq_id] = request.output_lens[0]
        self._sibling_targets[request.request_id] = request.output_lens
        self._groups[request.request_id] = seq_group
        self.results[request.request_id] = RequestResult(request.request_id, self.current_step, request.n,
                                                         arrival_ms=self.now_ms)
        self.scheduler.add_seq_group(seq_group)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort the requests that have arrived and not finished; returns their ids."""
        live = [rid for rid in request_ids
                if rid in self._groups and self.results[rid].finish_step is None]
        self.scheduler.abort_seq_group(live)
        for rid in live:
            self._record_finish(self._groups[rid])
        self._aborted_before_step.extend(live)
        return live

    def _record_finish(self, seq_group: SequenceGroup) -> None:
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
        result.finish_ms = self.now_ms
        result.num_output_tokens = sum(s.get_output_len() for s in seq_group.get_seqs())

    def _advance_clock(self, outputs: SchedulerOutputs) -> None:
        num_swapped = len(outputs.blocks_to_swap_in) + len(outputs.blocks_to_swap_out)
        self.now_ms += self.cost_model.step_ms(outputs.num_batched_tokens, num_swapped,
                                               self.cache_config.block_size)
        for scheduled in outputs.scheduled_seq_groups:
            result = self.results[scheduled.seq_group.request_id]
            if result.first_token_step == self.current_step and result.first_token_ms is None:
                result.first_token_ms = self.now_ms

    def _stats(self) -> SimStats:
        return summarize(self.snapshots, self.results, self.scheduler_config.max_num_seqs)


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
