"""The scheduler: which groups run in the next model step, with how many tokens each.

Mirrors `vllm/core/scheduler.py` (v0, ~0.6). Each `schedule()` moves `SequenceGroup`s between
three queues and returns the batch:

    waiting  new prompts, and groups preempted by recompute (their KV cache was dropped)
    running  groups with blocks on the GPU: decoding, or (chunked prefill) mid-prompt
    swapped  groups preempted by swap (their KV cache sits in the CPU pool)

`_schedule_default` makes a step all prefills or all decodes; `_schedule_chunked_prefill`
mixes decodes and prompt chunks cut to the token budget. LoRA adapters and a KV connector are
asked through `lora_slots` and `kv_connector`, whose defaults do nothing.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, LoRAConfig, SchedulerConfig, resolve_obj_by_qualname
from minivllm.core.block_manager import AllocStatus, BlockSpaceManager
from minivllm.core.kv_connector_hook import NoKVConnector
from minivllm.core.lookahead import LookaheadSlotsMixin
from minivllm.core.lora_slots import LoRASlots
from minivllm.core.policy import PolicyFactory
from minivllm.core.priority_preemption import PriorityPreemptionMixin
from minivllm.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus

BlockMapping = list[tuple[int, int]]


class PreemptionMode(enum.Enum):
    """SWAP moves a group's blocks to the CPU pool and back; RECOMPUTE drops them and
    prefills prompt + generated tokens again later (cheap for short sequences)."""

    SWAP = enum.auto()
    RECOMPUTE = enum.auto()


@dataclass
class SchedulingBudget:
    """Tokens and sequences still free in one step, counted once per request (a running
    group's sequences are counted at the start of the step and added again when scheduled)."""

    token_budget: int
    max_num_seqs: int
    _token_request_ids: set[str] = field(default_factory=set)
    _seq_request_ids: set[str] = field(default_factory=set)
    num_batched_tokens: int = 0
    num_curr_seqs: int = 0

    def can_schedule(self, *, num_new_tokens: int, num_new_seqs: int) -> bool:
        return (self.num_batched_tokens + num_new_tokens <= self.token_budget
                and self.num_curr_seqs + num_new_seqs <= self.max_num_seqs)

    def remaining_token_budget(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def add_num_batched_tokens(self, request_id: str, num_batched_tokens: int) -> None:
        if request_id not in self._token_request_ids:
            self._token_request_ids.add(request_id)
            self.num_batched_tokens += num_batched_tokens

    def subtract_num_batched_tokens(self, request_id: str, num_batched_tokens: int) -> None:
        if request_id in self._token_request_ids:
            self._token_request_ids.remove(request_id)
            self.num_batched_tokens -= num_batched_tokens

    def add_num_seqs(self, request_id: str, num_curr_seqs: int) -> None:
        if request_id not in self._seq_request_ids:
            self._seq_request_ids.add(request_id)
            self.num_curr_seqs += num_curr_seqs

    def subtract_num_seqs(self, request_id: str, num_curr_seqs: int) -> None:
        if request_id in self._seq_request_ids:
            self._seq_request_ids.remove(request_id)
            self.num_curr_seqs -= num_curr_seqs


@dataclass
class ScheduledSequenceGroup:
    """A group in this step's batch. `token_chunk_size`: new tokens per sequence (the prompt
    chunk, or 1 for a decode); `num_lookahead_slots`: slots reserved beyond the next token."""

    seq_group: SequenceGroup
    token_chunk_size: int
    num_lookahead_slots: int = 0


@dataclass
class SchedulerOutputs:
    """The decision of one `schedule()` call. `scheduled_seq_groups`: prefills first, then
    decodes, longest first (the worker flattens the batch in this order; the decode kernel's
    longest programs start first). Block mappings: (src, dst) block numbers the worker applies
    before the model runs. `ignored_seq_groups`: finished unrun, FINISHED_IGNORED (can never
    fit) or FINISHED_ABORTED (no CPU swap space), with a reason."""

    scheduled_seq_groups: list[ScheduledSequenceGroup]
    num_prefill_groups: int
    num_batched_tokens: int
    blocks_to_swap_in: BlockMapping
    blocks_to_swap_out: BlockMapping
    blocks_to_copy: BlockMapping
    ignored_seq_groups: list[SequenceGroup]
    preempted: int
    kv_connector_metadata: object | None = None  # the KV connector's loads and saves, if any

    def is_empty(self) -> bool:
        return not (self.scheduled_seq_groups or self.blocks_to_swap_in
                    or self.blocks_to_swap_out or self.blocks_to_copy)


@dataclass
class _StepState:
    """Everything one `schedule()` call collects before it updates the queues."""

    budget: SchedulingBudget
    prefills: list[ScheduledSequenceGroup] = field(default_factory=list)  # new prompts
    # Running, then swapped-in groups: mid-prompt (chunked prefill), or decoding.
    running_prefills: list[ScheduledSequenceGroup] = field(default_factory=list)
    decodes: list[ScheduledSequenceGroup] = field(default_factory=list)
    preempted_by_recompute: list[SequenceGroup] = field(default_factory=list)
    preempted_by_swap: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_in: BlockMapping = field(default_factory=list)
    blocks_to_swap_out: BlockMapping = field(default_factory=list)
    blocks_to_copy: BlockMapping = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    curr_loras: set[int] = field(default_factory=set)  # adapter ids running after the step

    @property
    def num_preempted(self) -> int:
        return len(self.preempted_by_recompute) + len(self.preempted_by_swap)

    def scheduled(self) -> list[ScheduledSequenceGroup]:
        return self.prefills + self.running_prefills + self.decodes


class Scheduler(PriorityPreemptionMixin, LookaheadSlotsMixin):
    """Decides each step's batch. vLLM 0.6.3's arguments in its order, plus keyword-only `clock`
    (time source of request metrics) and `kv_connector` (None: `NoKVConnector`). The optional
    modes' methods live beside it: `priority_preemption.py`, `lookahead.py` (multi-step)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 lora_config: LoRAConfig | None = None, pipeline_parallel_size: int = 1,
                 output_proc_callback: Callable | None = None, *,
                 clock: Callable[[], float] = time.monotonic, kv_connector: object | None = None) -> None:
        if pipeline_parallel_size != 1:
            raise ValueError(f"minivllm runs on one device: pipeline_parallel_size must be 1, "
                             f"got {pipeline_parallel_size}.")
        if output_proc_callback is not None:
            raise ValueError("output_proc_callback must be None: the engine processes outputs "
                             "itself (no asynchronous output processing).")
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set (the worker's profile "
                             "run fills it in; a simulation sets it by hand).")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.lora_config = lora_config
        self.lora_slots = LoRASlots.from_config(lora_config)
        self.clock = clock
        self.kv_connector = kv_connector or NoKVConnector()
        self.policy = PolicyFactory.get_policy(scheduler_config.policy)
        block_manager_cls = resolve_obj_by_qualname(scheduler_config.block_manager_cls)
        self.block_manager: BlockSpaceManager = block_manager_cls(
            cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks or 0,
            enable_caching=cache_config.enable_prefix_caching)
        # Without chunking a whole prompt must fit in one step's token budget.
        self.prompt_limit = scheduler_config.max_model_len
        if not scheduler_config.enable_chunked_prefill:
            self.prompt_limit = min(self.prompt_limit, scheduler_config.max_num_batched_tokens)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.num_cumulative_preemption = 0

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> None:
        """Finish these requests as FINISHED_ABORTED wherever they are; unknown ids are ignored."""
        request_ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in [g for g in queue if g.request_id in request_ids]:
                queue.remove(seq_group)
                self._finish_group(seq_group, SequenceStatus.FINISHED_ABORTED, "aborted")

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def get_prefix_cache_hit_rate(self) -> float:
        return self.block_manager.get_prefix_cache_hit_rate()

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        self.block_manager.fork(parent_seq, child_seq)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        """Free the blocks of finished sequences; drop finished groups from `running`."""
        for seq_group in self.running:
            if seq_group.is_finished():
                self._report_finished(seq_group)
            for seq in seq_group.get_finished_seqs():
                self.free_seq(seq)
        self.running = deque(g for g in self.running if not g.is_finished())

    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs, bool]:
        """Pick this step's batch: the worker's per-group metadata, the decision, and vLLM's
        `allow_async_output_proc` (always False: no asynchronous output processing)."""
        chunked = self.scheduler_config.enable_chunked_prefill
        outputs = self._schedule_chunked_prefill() if chunked else self._schedule_default()
        now = self.clock()
        metadata = []
        for scheduled in outputs.scheduled_seq_groups:
            seq_group = scheduled.seq_group
            if seq_group.metrics.first_scheduled_time is None:
                seq_group.metrics.first_scheduled_time = now
                seq_group.metrics.time_in_queue = now - seq_group.arrival_time
            metadata.append(self._make_metadata(scheduled))
            # The step runs before the next schedule: its full blocks may be cached now.
            self.block_manager.mark_blocks_as_computed(seq_group, scheduled.token_chunk_size)
        outputs.kv_connector_metadata = self.kv_connector.build_connector_meta(outputs)
        return metadata, outputs, False

    def _schedule_default(self) -> SchedulerOutputs:
        state = self._start_step()
        if not self.swapped:
            self._schedule_prefills(state, enable_chunking=False)
        if not state.prefills:
            if self.scheduler_config.policy == "priority":
                self._schedule_priority_preemption(state, enable_chunking=False)
            self._schedule_running(state, enable_chunking=False)
            if state.num_preempted == 0:
                self._schedule_swapped(state, enable_chunking=False)
        return self._finish_step(state)

    def _schedule_chunked_prefill(self) -> SchedulerOutputs:
        state = self._start_step()
        if self.scheduler_config.policy == "priority":
            self._schedule_priority_preemption(state, enable_chunking=True)
        self._schedule_running(state, enable_chunking=True)
        if state.num_preempted == 0:
            self._schedule_swapped(state, enable_chunking=True)
        self._schedule_prefills(state, enable_chunking=True)
        return self._finish_step(state)

    def _start_step(self) -> _StepState:
        self.waiting = deque(sorted(self.waiting, key=self.policy.sort_key))
        self.swapped = deque(sorted(self.swapped, key=self.policy.sort_key))
        budget = SchedulingBudget(self.scheduler_config.max_num_batched_tokens,
                                  self.scheduler_config.max_num_seqs)
        for seq_group in self.running:
            budget.add_num_seqs(seq_group.request_id, seq_group.get_max_num_running_seqs())
        return _StepState(budget=budget, curr_loras=self.lora_slots.in_use(self.running))

    def _finish_step(self, state: _StepState) -> SchedulerOutputs:
        """Put every group in its new queue and package the decision."""
        self.waiting.extendleft(state.preempted_by_recompute)
        self.waiting = deque(sorted(self.waiting, key=self.policy.sort_key))
        self.running.extend(s.seq_group for s in state.scheduled())
        self.swapped.extend(state.preempted_by_swap)
        decodes = sorted(state.decodes, key=lambda s: s.seq_group.seqs[0].get_len(), reverse=True)
        return SchedulerOutputs(
            scheduled_seq_groups=state.prefills + state.running_prefills + decodes,
            num_prefill_groups=len(state.prefills) + len(state.running_prefills),
            num_batched_tokens=state.budget.num_batched_tokens,
            blocks_to_swap_in=state.blocks_to_swap_in,
            blocks_to_swap_out=state.blocks_to_swap_out,
            blocks_to_copy=state.blocks_to_copy,
            ignored_seq_groups=state.ignored,
            preempted=state.num_preempted,
        )

    def _schedule_prefills(self, state: _StepState, enable_chunking: bool) -> None:
        """Admit waiting prompts in queue order until one does not fit (head-of-line)."""
        budget = state.budget
        passed_over: list[SequenceGroup] = []  # one adapter too many: they keep their place
        while self.waiting:
            seq_group = self.waiting[0]
            if not self.lora_slots.admits(seq_group, state.curr_loras):
                passed_over.append(self.waiting.popleft())
                continue
            alloc_status = self.block_manager.can_allocate(seq_group)
            reason = self._why_never_admissible(seq_group, state, alloc_status)
            if reason is not None:
                self.waiting.popleft()
                self._finish_group(seq_group, SequenceStatus.FINISHED_IGNORED, reason)
                state.ignored.append(seq_group)
                continue
            if alloc_status != AllocStatus.OK:
                break  # LATER: wait until running requests free blocks
            seq = self._waiting_seq(seq_group)
            # Never the whole prompt: the block manager leaves the last token to compute.
            num_local_tokens = self.block_manager.get_num_cached_tokens(seq)
            # An outside store's blocks after the local hits count as cached too.
            num_external_tokens, _ = self.kv_connector.get_num_new_matched_tokens(seq_group, num_local_tokens)
            num_cached_tokens = num_local_tokens + num_external_tokens
            num_new_tokens = self._chunk(seq.get_len() - num_cached_tokens, 1, budget,
                                         enable_chunking)
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_new_tokens == 0 or not budget.can_schedule(num_new_tokens=num_new_tokens,
                                                              num_new_seqs=num_new_seqs):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq_group)
            seq.status = SequenceStatus.RUNNING
            # The cached prefix is already in the KV cache (or loads in this step): skip it.
            seq.data.num_computed_tokens = num_local_tokens
            self.kv_connector.update_state_after_alloc(seq_group, self.block_manager.get_block_table(seq),
                                                       num_external_tokens)
            seq.data.num_computed_tokens = num_cached_tokens
            if seq_group.num_cached_tokens is None:  # vLLM's RequestOutput field: the first admission's
                seq_group.num_cached_tokens = num_cached_tokens
            state.prefills.append(ScheduledSequenceGroup(seq_group, num_new_tokens))
            budget.add_num_batched_tokens(seq_group.request_id, num_new_tokens)
            budget.add_num_seqs(seq_group.request_id, num_new_seqs)
            self.lora_slots.take(seq_group, state.curr_loras)
        self.waiting.extendleft(reversed(passed_over))

    def _why_never_admissible(self, seq_group: SequenceGroup, state: _StepState,
                              alloc_status: AllocStatus) -> str | None:
        """Why this waiting group can never be scheduled, or None. `alloc_status`: its
        `can_allocate` answer, asked once."""
        seq = self._waiting_seq(seq_group)
        num_tokens = seq.get_len()
        if num_tokens > self.prompt_limit:
            return (f"prompt of {num_tokens} tokens exceeds the limit of {self.prompt_limit} "
                    f"(max_model_len={self.scheduler_config.max_model_len}, max_num_batched_tokens="
                    f"{self.scheduler_config.max_num_batched_tokens}, chunked prefill "
                    f"{'on' if self.scheduler_config.enable_chunked_prefill else 'off'}).")
        num_seqs = seq_group.get_max_num_running_seqs()
        if num_seqs > self.scheduler_config.max_num_seqs:
            return (f"request needs {num_seqs} sequences (n / best_of) but max_num_seqs is "
                    f"{self.scheduler_config.max_num_seqs}.")
        if alloc_status == AllocStatus.NEVER or (alloc_status == AllocStatus.LATER and self._gpu_idle(state)):
            bm = self.block_manager
            return (f"prompt of {num_tokens} tokens needs {bm.get_num_required_blocks(seq)} KV-cache blocks; the "
                    f"GPU pool has {bm.num_total_gpu_blocks} blocks with {bm.watermark_blocks} "
                    f"kept free (watermark), so it can never fit (AllocStatus.NEVER).")
        return None

    def _waiting_seq(self, seq_group: SequenceGroup) -> Sequence:
        seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
        if len(seqs) != 1:
            raise RuntimeError(f"request {seq_group.request_id} is waiting with {len(seqs)} "
                               "sequences; a waiting group has exactly one prompt sequence.")
        return seqs[0]

    def _schedule_running(self, state: _StepState, enable_chunking: bool) -> None:
        """Give every running group its next tokens, preempting when blocks run out."""
        self.running = deque(sorted(self.running, key=self._running_key(enable_chunking)))
        while self.running:
            seq_group = self.running[0]
            num_new_tokens = self._num_new_tokens(seq_group, SequenceStatus.RUNNING,
                                                  state.budget, enable_chunking)
            if num_new_tokens == 0:
                break  # token budget spent; the rest stay running, unscheduled
            self.running.popleft()
            lookahead = 0 if seq_group.is_prefill() else self._num_lookahead_slots(seq_group)
            if self._make_room_for(seq_group, state, lookahead):
                self._add_running(seq_group, state, num_new_tokens, lookahead)

    def _add_running(self, seq_group: SequenceGroup, state: _StepState, num_new_tokens: int,
                     num_lookahead_slots: int = 0) -> None:
        """Reserve the slots of a running or swapped-in group and put it in the batch."""
        self._append_slots(seq_group, state, num_lookahead_slots)
        if seq_group.is_prefill():
            state.running_prefills.append(ScheduledSequenceGroup(seq_group, num_new_tokens))
        else:
            state.decodes.append(ScheduledSequenceGroup(seq_group, 1, num_lookahead_slots))
        state.budget.add_num_batched_tokens(seq_group.request_id, num_new_tokens)
        state.budget.add_num_seqs(seq_group.request_id, seq_group.get_max_num_running_seqs())

    def _make_room_for(self, seq_group: SequenceGroup, state: _StepState, num_lookahead_slots: int = 0) -> bool:
        """Preempt from the back of the running queue until `seq_group` can grow by one token
        per sequence (plus lookahead slots). False if `seq_group` itself was preempted."""
        while not self._can_append_slots(seq_group, num_lookahead_slots):
            victim = self.running.pop() if self.running else seq_group
            state.budget.subtract_num_seqs(victim.request_id, victim.get_max_num_running_seqs())
            self._preempt(victim, state)
            if victim is seq_group:
                return False
        return True

    def _can_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> bool:
        """vLLM v0's rule (one free block per running sequence), waived when no sequence needs a
        new block: a group filling the whole pool would otherwise preempt itself forever."""
        if self.block_manager.can_append_slots(seq_group, num_lookahead_slots):
            return True
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        tables = [self.block_manager.get_block_table(seq) for seq in seqs]
        last_blocks = [table[-1] for table in tables if table]
        if len(set(last_blocks)) != len(last_blocks):
            return False  # siblings share a last block: a write needs a copy (a new block)
        # Only the last block of a sequence can take new tokens, and it is never shared
        # across requests: the prefix cache only shares full, computed blocks.
        size = self.block_manager.block_size
        return all(len(table) >= -(-(seq.get_len() + num_lookahead_slots) // size)
                   for seq, table in zip(seqs, tables))

    def _append_slots(self, seq_group: SequenceGroup, state: _StepState, num_lookahead_slots: int = 0) -> None:
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            state.blocks_to_copy.extend(self.block_manager.append_slots(seq, num_lookahead_slots))

    def _schedule_swapped(self, state: _StepState, enable_chunking: bool) -> None:
        """Swap groups back in (queue order) while the GPU pool and the budget allow."""
        passed_over: list[SequenceGroup] = []
        while self.swapped:
            seq_group = self.swapped[0]
            if not self.lora_slots.admits(seq_group, state.curr_loras):
                passed_over.append(self.swapped.popleft())
                continue
            status = self.block_manager.can_swap_in(seq_group)
            if status == AllocStatus.LATER and self._gpu_idle(state):
                status = AllocStatus.NEVER  # the watermark alone keeps it out, forever
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._finish_group(seq_group, SequenceStatus.FINISHED_IGNORED,
                                   "swapped-out request can never fit back in the GPU pool.")
                state.ignored.append(seq_group)
                continue
            num_new_tokens = self._num_new_tokens(seq_group, SequenceStatus.SWAPPED,
                                                  state.budget, enable_chunking)
            if num_new_tokens == 0 or not state.budget.can_schedule(
                    num_new_tokens=num_new_tokens,
                    num_new_seqs=seq_group.get_max_num_running_seqs()):
                break
            self.swapped.popleft()
            state.blocks_to_swap_in.extend(self.block_manager.swap_in(seq_group))
            for seq in seq_group.get_seqs(status=SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._add_running(seq_group, state, num_new_tokens)
            self.lora_slots.take(seq_group, state.curr_loras)
        self.swapped.extendleft(reversed(passed_over))

    def _preempt(self, seq_group: SequenceGroup, state: _StepState) -> None:
        """Recompute a one-sequence group, swap otherwise; with the CPU pool full a lone
        sequence is recomputed and a group of several aborted."""
        mode = self._preemption_mode(seq_group)
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(seq_group):
            if seq_group.num_seqs(status=SequenceStatus.RUNNING) == 1:
                mode = PreemptionMode.RECOMPUTE
            else:
                self._finish_group(
                    seq_group, SequenceStatus.FINISHED_ABORTED,
                    "aborted due to the lack of CPU swap space: the request had to be preempted "
                    "by swap (several sequences cannot be recomputed) and the CPU pool is full. "
                    "Increase swap_space.")
                state.ignored.append(seq_group)
                return
        if mode == PreemptionMode.RECOMPUTE:
            self._preempt_by_recompute(seq_group, state)
        else:
            self._preempt_by_swap(seq_group, state)

    def _preemption_mode(self, seq_group: SequenceGroup) -> PreemptionMode:
        if seq_group.num_seqs(status=SequenceStatus.RUNNING) > 1:
            return PreemptionMode.SWAP  # only a lone sequence can restart as a prompt
        user_mode = self.scheduler_config.preemption_mode
        if user_mode is not None:
            return PreemptionMode.SWAP if user_mode == "swap" else PreemptionMode.RECOMPUTE
        if seq_group.get_max_num_running_seqs() == 1:
            return PreemptionMode.RECOMPUTE
        return PreemptionMode.SWAP

    def _preempt_by_recompute(self, seq_group: SequenceGroup, state: _StepState) -> None:
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            seq.status = SequenceStatus.WAITING
            self.free_seq(seq)  # frees first: with caching its computed blocks stay reusable
            seq.reset_state_for_recompute()
        self.num_cumulative_preemption += 1
        state.preempted_by_recompute.append(seq_group)

    def _preempt_by_swap(self, seq_group: SequenceGroup, state: _StepState) -> None:
        state.blocks_to_swap_out.extend(self.block_manager.swap_out(seq_group))
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED
        self.num_cumulative_preemption += 1
        state.preempted_by_swap.append(seq_group)

    def _running_key(self, enable_chunking: bool) -> Callable[[SequenceGroup], tuple]:
        if not enable_chunking:
            return self.policy.sort_key
        # Decode first (within a priority level): a decode costs one token, a chunk many.
        if self.scheduler_config.policy == "priority":
            return lambda g: (g.priority, g.is_prefill(), g.arrival_time)
        return lambda g: (g.is_prefill(), *self.policy.sort_key(g))

    def _num_new_tokens(self, seq_group: SequenceGroup, status: SequenceStatus,
                        budget: SchedulingBudget, enable_chunking: bool) -> int:
        """Tokens `seq_group` computes this step (0: it does not fit the token budget)."""
        seqs = seq_group.get_seqs(status=status)
        num_tokens = sum(seq.get_num_uncomputed_tokens() for seq in seqs)
        return self._chunk(num_tokens, len(seqs), budget, enable_chunking)

    @staticmethod
    def _chunk(num_tokens: int, num_seqs: int, budget: SchedulingBudget,
               enable_chunking: bool) -> int:
        remaining = budget.remaining_token_budget()
        if enable_chunking and num_seqs == 1:
            return min(num_tokens, remaining)  # a lone prompt may be cut into chunks
        return num_tokens if num_tokens <= remaining else 0

    def _gpu_idle(self, state: _StepState) -> bool:
        """No running group holds GPU blocks and none was scheduled: all blocks are free."""
        return not self.running and not state.scheduled()

    def _finish_group(self, seq_group: SequenceGroup, status: SequenceStatus, reason: str) -> None:
        for seq in seq_group.get_unfinished_seqs():
            seq.status = status
        self._report_finished(seq_group)
        for seq in seq_group.get_seqs():
            self.free_seq(seq)  # a no-op for a sequence without blocks
        if seq_group.finish_message is None:
            seq_group.finish_message = reason

    def _report_finished(self, seq_group: SequenceGroup) -> None:
        """Tell the KV connector a request ended (before its blocks are freed)."""
        seq = seq_group.first_seq
        block_ids = self.block_manager.get_block_table(seq) if self.block_manager.has_blocks(seq) else []
        self.kv_connector.request_finished(seq_group, block_ids)

    def _make_metadata(self, scheduled: ScheduledSequenceGroup) -> SequenceGroupMetadata:
        seq_group = scheduled.seq_group
        seqs = seq_group.get_seqs(status=SequenceStatus.RUNNING)
        is_prompt = seq_group.is_prefill()
        # A chunk that stops short of the end of the prompt produces no token.
        do_sample = not is_prompt or (seqs[0].get_num_computed_tokens() + scheduled.token_chunk_size
                                      >= seqs[0].get_len())
        return SequenceGroupMetadata(
            request_id=seq_group.request_id,
            is_prompt=is_prompt,
            seq_data={seq.seq_id: seq.data for seq in seqs},
            sampling_params=seq_group.sampling_params,
            block_tables={seq.seq_id: self.block_manager.get_block_table(seq) for seq in seqs},
            token_chunk_size=scheduled.token_chunk_size,
            do_sample=do_sample,
            num_lookahead_slots=scheduled.num_lookahead_slots,
            lora_request=seq_group.lora_request,
        )
