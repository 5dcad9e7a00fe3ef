"""One picture-ready record of a scheduler step: `StepSnapshot` and `take_snapshot`.

The model-free simulator (`minivllm.sim`) and the engine (`LLMEngine.step`) both call
`take_snapshot` right after `Scheduler.schedule()`, so notebooks draw the same queue, batch
and memory pictures from a simulation or from a real model. Plain data only (ids, ints,
lists): a trace of snapshots can be kept, compared and drawn long after the run.

    metadata, outputs = scheduler.schedule()
    snapshot = take_snapshot(scheduler, outputs, step)
    ... run the model, append tokens, free finished groups ...
    snapshot.finished.extend(ids_of_requests_that_finished)   # known only after the step
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.core.block_manager import BlockManagerSnapshot
from minivllm.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:  # type hints only: keeps the import graph scheduler -> snapshot one-way
    from minivllm.core.scheduler import Scheduler, SchedulerOutputs


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
    # Filled by the caller after the step ran.
    finished: list[str] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
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


def take_snapshot(scheduler: Scheduler, scheduler_outputs: SchedulerOutputs, step: int,
                  time: float | None = None, finished_request_ids: Iterable[str] = (),
                  include_block_manager: bool = False) -> StepSnapshot:
    """Record the scheduler's state right after `schedule()` returned `scheduler_outputs`.

    Args:
        scheduler: the scheduler (read only).
        scheduler_outputs: what `schedule()` just returned.
        step: the step number.
        time: optional time stamp to store.
        finished_request_ids: requests already known to have finished this step.
        include_block_manager: also store the full `BlockManagerSnapshot` (ref counts, free
            lists, cached blocks); costs time and memory on big pools.
    """
    bm = scheduler.block_manager
    outputs = scheduler_outputs
    return StepSnapshot(
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
        block_tables=_block_tables(scheduler, scheduler.running, SequenceStatus.RUNNING),
        cpu_block_tables=_block_tables(scheduler, scheduler.swapped, SequenceStatus.SWAPPED),
        preempted=outputs.preempted,
        preempted_by_recompute=list(outputs.preempted_by_recompute),
        preempted_by_swap=list(outputs.preempted_by_swap),
        swapped_in=list(outputs.swapped_in),
        blocks_to_swap_in=list(outputs.blocks_to_swap_in),
        blocks_to_swap_out=list(outputs.blocks_to_swap_out),
        blocks_to_copy=list(outputs.blocks_to_copy),
        ignored={g.request_id: g.finish_message or "" for g in outputs.ignored_seq_groups},
        finished=list(finished_request_ids),
        time=time,
        block_manager=bm.snapshot() if include_block_manager else None,
    )


def _batch_entry(seq_group: SequenceGroup, token_chunk_size: int, is_prefill: bool) -> BatchEntry:
    seq_ids = [seq.seq_id for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING)]
    return BatchEntry(
        request_id=seq_group.request_id,
        seq_ids=seq_ids,
        num_tokens=token_chunk_size * len(seq_ids),
        phase="prefill" if is_prefill else "decode",
    )


def _block_tables(scheduler: Scheduler, queue: Iterable[SequenceGroup],
                  status: SequenceStatus) -> dict[str, dict[int, list[int]]]:
    return {
        g.request_id: {s.seq_id: scheduler.block_manager.get_block_table(s)
                       for s in g.get_seqs(status=status)}
        for g in queue
    }
