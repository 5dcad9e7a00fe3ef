"""Picture-ready records of the engine's state, taken from outside the runtime.

`SnapshotRecorder` is a `StepObserver`: attached to an `LLMEngine`, it records one
`StepSnapshot` per step (queues, batch, block tables, block moves, what finished) by reading
the scheduler and the block manager through their public queries. The simulator
(`minivllm.viz.sim`) records its runs the same way, so notebooks draw the same pictures from
a simulation or from a real model. Plain data only (ids, ints, lists): a trace can be kept,
compared and drawn long after the run.

    recorder = SnapshotRecorder(engine)          # attaches itself
    while engine.has_unfinished_requests():
        engine.step()
    recorder.snapshots[3].running                # queue view at step 3

`snapshot_block_manager(block_manager, seqs)` copies the blocks in use (not the whole pool)
for the block pictures (`minivllm.viz.blocks`). Preemptions and swap-ins are found by
comparing each group's queue with the previous step's (running -> waiting: recompute;
running -> swapped: swap; swapped -> running: swap-in; gone from every queue: aborted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.core.block_manager import BlockSpaceManager
from minivllm.engine.llm_engine import StepObserver
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from minivllm.core.scheduler import Scheduler, SchedulerOutputs
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.outputs import RequestOutput

_QUEUES = ("waiting", "running", "swapped")
# Free blocks listed by a block-manager snapshot, in hand-out order: every free block of a
# notebook-sized pool, a bounded head of a GPU-sized one.
MAX_LISTED_FREE_BLOCKS = 4096


# =============================================================== block manager
@dataclass
class BlockSnapshot:
    """One physical block as a picture shows it."""

    block_number: int
    ref_count: int
    token_ids: tuple[int, ...]  # tokens it holds (as seen by its first holder, or cached)
    block_hash: int | None
    cached: bool  # registered in the prefix cache


@dataclass
class BlockManagerSnapshot:
    """Plain-data copy of the paged KV cache, for `minivllm.viz.blocks` and tests.

    Block tables map seq_id -> physical block numbers. Only blocks in use are stored
    (`*_blocks_in_use`: referenced or cached); `gpu_blocks` / `cpu_blocks` fill in the free
    ones when a picture asks. `free_*_block_ids` lists the free list in hand-out order (at
    most `MAX_LISTED_FREE_BLOCKS`; the counts are `num_free_*_blocks`, which like the block
    manager count evictable cached blocks as free); `cached_gpu_block_ids` lists the
    unreferenced cached blocks in eviction order (next victim first).
    """

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    watermark_blocks: int
    gpu_block_tables: dict[int, list[int]]
    cpu_block_tables: dict[int, list[int]]
    seq_token_ids: dict[int, list[int]]
    gpu_blocks_in_use: dict[int, BlockSnapshot]
    cpu_blocks_in_use: dict[int, BlockSnapshot]
    free_gpu_block_ids: list[int]
    free_cpu_block_ids: list[int]
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    cached_gpu_block_ids: list[int] = field(default_factory=list)
    prefix_cache_hit_rate: float = 0.0

    @property
    def gpu_blocks(self) -> list[BlockSnapshot]:
        """Every GPU block in block-number order (free ones built here, for drawing)."""
        return _whole_pool(self.gpu_blocks_in_use, self.num_gpu_blocks)

    @property
    def cpu_blocks(self) -> list[BlockSnapshot]:
        return _whole_pool(self.cpu_blocks_in_use, self.num_cpu_blocks)


def _whole_pool(in_use: dict[int, BlockSnapshot], num_blocks: int) -> list[BlockSnapshot]:
    return [in_use.get(n) or BlockSnapshot(n, 0, (), None, False) for n in range(num_blocks)]


def snapshot_block_manager(block_manager: BlockSpaceManager, seqs: Iterable[Sequence],
                           max_listed_free_blocks: int = MAX_LISTED_FREE_BLOCKS) -> BlockManagerSnapshot:
    """Copy the block tables of `seqs` (those without blocks are skipped), the blocks they
    hold, the cached blocks and the head of each free list. The block manager does not know
    sequences, only their ids, so the caller names them (a scheduler's queues, a notebook's
    list); a block held by a sequence not given shows as free."""
    bm = block_manager
    tables: dict[bool, dict[int, list[int]]] = {False: {}, True: {}}  # on CPU? -> tables
    in_use: dict[bool, dict[int, BlockSnapshot]] = {False: {}, True: {}}
    seq_token_ids: dict[int, list[int]] = {}
    for seq in seqs:
        if not bm.has_blocks(seq):
            continue
        on_cpu = bm.is_swapped_out(seq)
        table = bm.get_block_table(seq)
        tables[on_cpu][seq.seq_id] = table
        seq_token_ids[seq.seq_id] = token_ids = seq.get_token_ids()
        allocator = bm.cpu_allocator if on_cpu else bm.gpu_allocator
        for i, block_number in enumerate(table):
            if block_number not in in_use[on_cpu]:
                tokens = tuple(token_ids[i * bm.block_size:(i + 1) * bm.block_size])
                in_use[on_cpu][block_number] = _block(allocator.get_block_info(block_number), tokens)
    cached_ids = bm.gpu_allocator.get_evictable_block_ids()
    for block_number in cached_ids:
        info = bm.gpu_allocator.get_block_info(block_number)
        in_use[False][block_number] = _block(info, info.token_ids)
    return BlockManagerSnapshot(
        block_size=bm.block_size,
        num_gpu_blocks=bm.num_total_gpu_blocks,
        num_cpu_blocks=bm.num_total_cpu_blocks,
        watermark_blocks=bm.watermark_blocks,
        gpu_block_tables=tables[False],
        cpu_block_tables=tables[True],
        seq_token_ids=seq_token_ids,
        gpu_blocks_in_use=in_use[False],
        cpu_blocks_in_use=in_use[True],
        free_gpu_block_ids=bm.gpu_allocator.get_free_block_ids(max_listed_free_blocks),
        free_cpu_block_ids=bm.cpu_allocator.get_free_block_ids(max_listed_free_blocks),
        num_free_gpu_blocks=bm.get_num_free_gpu_blocks(),
        num_free_cpu_blocks=bm.get_num_free_cpu_blocks(),
        cached_gpu_block_ids=cached_ids,
        prefix_cache_hit_rate=bm.get_prefix_cache_hit_rate(),
    )


def _block(info, token_ids: tuple[int, ...]) -> BlockSnapshot:
    return BlockSnapshot(info.block_number, info.ref_count, token_ids or info.token_ids,
                         info.block_hash, info.cached)


# ======================================================================== steps
@dataclass
class BatchEntry:
    """One scheduled group in a step's batch.

    `num_tokens` counts the tokens the group computes this step (a prompt chunk, or one
    per sequence for a decode). `phase` is "prefill" or "decode" ("idle" is used only by the
    static-batching baseline for a padded slot whose request already ended).
    """

    request_id: str
    seq_ids: list[int]
    num_tokens: int
    phase: str

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"


@dataclass
class StepSnapshot:
    """The scheduler's state and decision at one step (queues in their order after it)."""

    step: int
    waiting: list[str]
    running: list[str]
    swapped: list[str]
    batch: list[BatchEntry]
    num_batched_tokens: int
    # Memory: pool sizes, free blocks (cached-but-unreferenced GPU blocks count as free).
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    # request_id -> {seq_id -> physical block numbers}, on the GPU and in the CPU pool.
    block_tables: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    cpu_block_tables: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    preempted: int = 0
    preempted_by_recompute: list[str] = field(default_factory=list)
    preempted_by_swap: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # request_id -> why the scheduler finished it without running it (ignored / aborted).
    ignored: dict[str, str] = field(default_factory=dict)
    # Known only after the step ran (the recorder fills them in).
    finished: list[str] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # aborted since the previous step
    time: float | None = None  # simulated or wall-clock time at the end of the step
    block_manager: BlockManagerSnapshot | None = None  # full pool state, when asked for

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self.num_free_gpu_blocks

    @property
    def num_swapped_blocks(self) -> int:
        """CPU blocks holding swapped-out KV cache."""
        return self.num_cpu_blocks - self.num_free_cpu_blocks

    @property
    def num_scheduled_seqs(self) -> int:
        return sum(len(e.seq_ids) for e in self.batch if e.phase != "idle")

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.batch if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_tokens for e in self.batch if e.phase == "decode")


def queue_of_each_request(scheduler: Scheduler) -> dict[str, str]:
    """request_id -> "waiting" / "running" / "swapped"."""
    return {g.request_id: name for name in _QUEUES for g in getattr(scheduler, name)}


def take_snapshot(scheduler: Scheduler, scheduler_outputs: SchedulerOutputs, step: int,
                  previous_queues: dict[str, str] | None = None,
                  include_block_manager: bool = False) -> StepSnapshot:
    """Record the scheduler's state right after `schedule()` returned `scheduler_outputs`.

    Args:
        scheduler: the scheduler (read only).
        scheduler_outputs: what `schedule()` just returned.
        step: the step number.
        previous_queues: `queue_of_each_request(scheduler)` at the end of the previous step,
            to tell preemptions, swap-ins and aborts (see the module docstring).
        include_block_manager: also store `snapshot_block_manager` (ref counts, free lists,
            cached blocks) of every queued sequence.
    """
    bm = scheduler.block_manager
    outputs = scheduler_outputs
    before, now = previous_queues or {}, queue_of_each_request(scheduler)
    ignored = {g.request_id: g.finish_message or "" for g in outputs.ignored_seq_groups}
    snapshot = StepSnapshot(
        step=step,
        waiting=[g.request_id for g in scheduler.waiting],
        running=[g.request_id for g in scheduler.running],
        swapped=[g.request_id for g in scheduler.swapped],
        batch=[_batch_entry(s.seq_group, s.token_chunk_size, i < outputs.num_prefill_groups)
               for i, s in enumerate(outputs.scheduled_seq_groups)],
        num_batched_tokens=outputs.num_batched_tokens,
        num_gpu_blocks=bm.num_total_gpu_blocks,
        num_cpu_blocks=bm.num_total_cpu_blocks,
        num_free_gpu_blocks=bm.get_num_free_gpu_blocks(),
        num_free_cpu_blocks=bm.get_num_free_cpu_blocks(),
        block_tables=_block_tables(bm, scheduler.running, SequenceStatus.RUNNING),
        cpu_block_tables=_block_tables(bm, scheduler.swapped, SequenceStatus.SWAPPED),
        preempted=outputs.preempted,
        preempted_by_recompute=_moved(before, now, "running", "waiting"),
        preempted_by_swap=_moved(before, now, "running", "swapped"),
        swapped_in=_moved(before, now, "swapped", "running"),
        blocks_to_swap_in=list(outputs.blocks_to_swap_in),
        blocks_to_swap_out=list(outputs.blocks_to_swap_out),
        blocks_to_copy=list(outputs.blocks_to_copy),
        ignored=ignored,
        aborted=[rid for rid in before if rid not in now and rid not in ignored],
    )
    if include_block_manager:
        seqs = [seq for name in _QUEUES for g in getattr(scheduler, name) for seq in g.get_seqs()]
        snapshot.block_manager = snapshot_block_manager(bm, seqs)
    return snapshot


def _moved(before: dict[str, str], now: dict[str, str], src: str, dst: str) -> list[str]:
    return [rid for rid, queue in now.items() if queue == dst and before.get(rid) == src]


def _batch_entry(seq_group: SequenceGroup, token_chunk_size: int, is_prefill: bool) -> BatchEntry:
    seq_ids = [seq.seq_id for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING)]
    return BatchEntry(
        request_id=seq_group.request_id,
        seq_ids=seq_ids,
        num_tokens=token_chunk_size * len(seq_ids),
        phase="prefill" if is_prefill else "decode",
    )


def _block_tables(bm: BlockSpaceManager, queue: Iterable[SequenceGroup],
                  status: SequenceStatus) -> dict[str, dict[int, list[int]]]:
    return {g.request_id: {s.seq_id: bm.get_block_table(s) for s in g.get_seqs(status=status)}
            for g in queue}


# ===================================================================== recorder
class SnapshotRecorder(StepObserver):
    """Records a `StepSnapshot` of every engine step; attaches itself to `engine`.

    Args:
        engine: the `LLMEngine` to observe.
        include_block_manager: store each step's `BlockManagerSnapshot` too (costs time and
            memory in proportion to the blocks in use).
        clock: the time stamped on each snapshot at the end of its step (default:
            `time.monotonic`; the simulator passes its cost model's clock).
    """

    def __init__(self, engine: LLMEngine, *, include_block_manager: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.include_block_manager = include_block_manager
        self.clock = clock
        self.snapshots: list[StepSnapshot] = []
        self._queues: dict[str, str] = queue_of_each_request(engine.scheduler)
        self._current: StepSnapshot | None = None
        self._finished_before: set[int] = set()
        engine.add_step_observer(self)

    def detach(self) -> None:
        """Stop recording (the snapshots taken so far stay)."""
        self.engine.remove_step_observer(self)

    def on_scheduled(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs) -> None:
        self._current = take_snapshot(engine.scheduler, scheduler_outputs, engine.step_counter,
                                      self._queues, self.include_block_manager)
        self._finished_before = {seq.seq_id for s in scheduler_outputs.scheduled_seq_groups
                                 for seq in s.seq_group.get_finished_seqs()}

    def on_step_end(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs,
                    request_outputs: list[RequestOutput]) -> None:
        snapshot, self._current = self._current, None
        if snapshot is None:  # attached between the two calls of a step
            return
        for scheduled in scheduler_outputs.scheduled_seq_groups:
            seq_group = scheduled.seq_group
            snapshot.finished_seq_ids.extend(seq.seq_id for seq in seq_group.get_finished_seqs()
                                             if seq.seq_id not in self._finished_before)
            if seq_group.is_finished():
                snapshot.finished.append(seq_group.request_id)
        snapshot.time = self.clock()
        self.snapshots.append(snapshot)
        self._queues = queue_of_each_request(engine.scheduler)
