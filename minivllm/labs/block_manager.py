"""Lab 01's checks: a learner's block allocator and block manager (block tables, reference
counts, copy-on-write), first on focused cases, then inside a real `LLM` (`block_manager_cls`).

Every expected value comes from the package's own `BlockAllocator` / `BlockSpaceManager` run on
the same operations (`Twin`), compared up to the numbering of physical blocks: a learner's free
list may hand out blocks in another order and still be right. After each operation both sides
must agree on each sequence's table (which logical blocks share a physical block), every block's
reference count, the free GPU / CPU blocks and the copy-on-write pairs. `prefix_caching.py`
(lab 02) drives the same `Twin` with caching on.
"""

from __future__ import annotations

import random
from typing import Callable

from minivllm.core.block_allocator import BlockAllocator, Device, OutOfBlocksError
from minivllm.core.block_manager import AllocStatus, BlockSpaceManager
from minivllm.entrypoints.llm import LLM
from minivllm.labs import LabCheckFailed, expect, passed
from minivllm.labs.parity import PROMPTS, assert_greedy_matches_transformers, stall_guard
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.viz.device import engine_kwargs as device_kwargs

# Prompts drawn from a few shared heads and a tiny vocabulary, so equal full blocks (prefix-cache
# hits) and near misses (same tokens after another head) both occur in random sequences.
HEADS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4])
NUM_RANDOM_SEQUENCES = 12
NUM_RANDOM_OPS = 60
NUM_FAILING_OPS_SHOWN = 8


# ============================================================================ the allocator
def check_block_allocator(allocator_cls: type) -> None:
    """`allocator_cls(device, block_size, num_blocks, enable_caching=False)`: allocate / incref /
    free / get_num_free_blocks against `BlockAllocator` on the same calls."""
    ref = BlockAllocator(Device.GPU, 4, 4, False)
    lab = allocator_cls(Device.GPU, 4, 4, False)
    log: list[str] = []

    def agree(what: str) -> None:
        log.append(what)
        expect(lab.get_num_free_blocks() == ref.get_num_free_blocks(),
               f"after\n{format_steps(log)}\nget_num_free_blocks() is {lab.get_num_free_blocks()}, "
               f"expected {ref.get_num_free_blocks()}")

    agree("a new pool of 4 blocks")
    ref_blocks, lab_blocks = [], []
    for i in range(4):
        ref_blocks.append(ref.allocate(now=1))
        block = lab.allocate(now=1)
        expect(block is lab.blocks[block.block_number],
               f"allocate() returned {block}, which is not the pool's own block "
               f"self.blocks[{block.block_number}]: hand out the objects of self.blocks")
        expect(block.ref_count == 1, f"allocate() #{i + 1}: the new block's ref_count is "
               f"{block.ref_count}, expected 1 (one holder: the table that asked for it)")
        expect(block not in lab_blocks, f"allocate() #{i + 1} handed out block "
               f"{block.block_number} again while it is still held (ref_count {block.ref_count})")
        lab_blocks.append(block)
        agree(f"allocate #{i + 1}")
    try:
        lab.allocate(now=2)
    except OutOfBlocksError:
        pass
    else:
        raise LabCheckFailed("allocate() on an empty pool returned a block: raise OutOfBlocksError")
    agree("allocate on an empty pool (OutOfBlocksError)")

    lab.incref(lab_blocks[0], 2, now=3)
    ref.incref(ref_blocks[0], 2, now=3)
    expect(lab_blocks[0].ref_count == 3,
           f"incref(block, 2) on a block with ref_count 1 left ref_count {lab_blocks[0].ref_count}, expected 3")
    agree("incref(block 0, 2)")
    for i in range(3):
        lab.free(lab_blocks[0], now=4)
        ref.free(ref_blocks[0], now=4)
        expect(lab_blocks[0].ref_count == 2 - i, f"free #{i + 1} of a block with ref_count {3 - i} left "
               f"ref_count {lab_blocks[0].ref_count}, expected {2 - i}")
        agree(f"free #{i + 1} of block 0 (ref_count {3 - i} -> {2 - i})")
    try:
        lab.free(lab_blocks[0], now=5)
    except ValueError:
        pass
    else:
        raise LabCheckFailed("free() of a block whose ref_count is 0 (a double free) passed silently: "
                             "raise ValueError, a double free would hand one block to two tables")
    agree("a double free (ValueError)")
    again = lab.allocate(now=6)
    ref.allocate(now=6)
    expect(again is lab_blocks[0] and again.ref_count == 1,
           f"after freeing block {lab_blocks[0].block_number} the only free block, allocate() returned "
           f"{again}, expected that block with ref_count 1")
    agree("allocate the freed block again")
    passed("block allocator: allocate, incref, free, double free, an empty pool")


# ============================================================================ the twin
def _label_tables(bm) -> tuple[dict[str, list[str]], dict[int, str]]:
    """Each table as labels G0, G1, ... / C0, ... in order of first appearance (seq ids in
    order): two managers agree up to block numbering iff their labelled tables agree."""
    labels: dict[int, str] = {}
    counts = {Device.GPU: 0, Device.CPU: 0}
    tables = {}
    for seq_id in sorted(bm.block_tables):
        row = []
        for block in bm.block_tables[seq_id]:
            if id(block) not in labels:
                labels[id(block)] = f"{block.device.name[0]}{counts[block.device]}"
                counts[block.device] += 1
            row.append(labels[id(block)])
        tables[f"seq {seq_id}"] = row
    return tables, labels


def manager_state(bm, caching: bool = False) -> dict[str, object]:
    """What must agree between two managers after every operation, block numbers left out."""
    tables, labels = _label_tables(bm)
    blocks = {id(b): b for table in bm.block_tables.values() for b in table}
    state: dict[str, object] = {
        "block tables": tables,
        "ref counts": {labels[key]: block.ref_count for key, block in blocks.items()},
        "free GPU blocks": bm.get_num_free_gpu_blocks(),
        "free CPU blocks": bm.get_num_free_cpu_blocks(),
    }
    if caching:
        allocator = bm.gpu_allocator
        content = lambda b: (b.num_hashed_tokens, b.token_ids)  # noqa: E731
        cached = [b for b in allocator.blocks if allocator.is_cached(b)]
        state["cached blocks (tokens up to its end, its tokens)"] = sorted(content(b) for b in cached)
        state["evictable blocks (cached, ref_count 0)"] = sorted(content(b) for b in cached if b.ref_count == 0)
        state["prefix-cache hit rate"] = bm.get_prefix_cache_hit_rate()
    return state


class Twin:
    """The same operations on the package's `BlockSpaceManager` and on `manager_cls`, compared
    after each one (`manager_state`); a failure names the case, the operations that led there,
    and the first quantity that differs, expected vs got. The sequences are shared: each
    operation calls both managers before it changes a sequence again."""

    def __init__(self, manager_cls: type, case: str, block_size: int = 4, num_gpu_blocks: int = 8,
                 num_cpu_blocks: int = 4, enable_caching: bool = False) -> None:
        kwargs = dict(watermark=0.0, enable_caching=enable_caching)
        self.case = case
        self.ref = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks, **kwargs)
        self.log: list[str] = [f"a manager with block_size={block_size}, {num_gpu_blocks} GPU and "
                               f"{num_cpu_blocks} CPU blocks, caching {'on' if enable_caching else 'off'}"]
        self.lab = self._call("__init__", manager_cls, block_size, num_gpu_blocks, num_cpu_blocks, **kwargs)
        self.block_size, self.caching = block_size, enable_caching
        self.groups: list[SequenceGroup] = []  # unfinished requests
        self.group_of: dict[int, SequenceGroup] = {}  # seq_id -> its request
        self._seq_ids = iter(range(10**9))
        self._request_ids = iter(range(10**9))
        self.num_copies = 0
        self.compare()

    # ------------------------------------------------------------------ operations
    def add(self, prompt: list[int], num_seqs: int = 1, lora_request=None) -> SequenceGroup | None:
        """A new request of `num_seqs` waiting sequences with this prompt, allocated and prefilled
        if it fits; None if it does not."""
        seqs = [Sequence(next(self._seq_ids), None, prompt, self.block_size, lora_request=lora_request)
                for _ in range(num_seqs)]
        group = SequenceGroup(str(next(self._request_ids)), seqs, arrival_time=0.0)
        return group if self._prefill(group, f"allocate request {group.request_id} "
                                             f"(seqs {_ids(seqs)}, prompt {_short(prompt)})") else None

    def append(self, group: SequenceGroup, rng: random.Random | None = None) -> None:
        """One decode step of `group`: every running sequence appends a token and gets its slot."""
        seqs = group.get_seqs(status=SequenceStatus.RUNNING)
        if not seqs or not self.ref.can_append_slots(group):
            return
        self.log.append(f"append a token to request {group.request_id} (seqs {_ids(seqs)})")
        for seq in seqs:
            seq.append_token_id(rng.randint(1, 4) if rng else 7, {})
            index = (seq.get_len() - 1) // self.block_size
            old = list(self.lab.block_tables.get(seq.seq_id, []))
            expected = self.ref.append_slots(seq)
            got = self._call(f"append_slots(seq {seq.seq_id})", self.lab.append_slots, seq)
            what = f"append_slots(seq {seq.seq_id}) (now {seq.get_len()} tokens, the new one in logical block {index})"
            self._expect(isinstance(got, list) and len(got) == len(expected),
                         f"{what} returned {got!r}, expected {len(expected)} copy-on-write pair(s)"
                         + (" [(src, dst)]: the block was shared" if expected else " ([]): the block is its own"))
            table = self.lab.block_tables[seq.seq_id]
            for src, dst in got:
                self._expect(index < len(old) and (src, dst) == (old[index].block_number, table[index].block_number),
                             f"{what} returned {(src, dst)}: expected (the shared block the table held there, the "
                             f"new block that replaces it) = ({old[index].block_number if index < len(old) else '?'}, "
                             f"{table[index].block_number})")
            self.num_copies += len(got)
        self._mark_computed(group, 1)
        group.update_num_computed_tokens(1)
        self.compare()

    def fork(self, parent: Sequence) -> Sequence:
        """A child sharing every block of `parent` (one more sample of the request)."""
        child = parent.fork(next(self._seq_ids))
        self.log.append(f"fork seq {parent.seq_id} -> seq {child.seq_id}")
        self.ref.fork(parent, child)
        self._call(f"fork(seq {parent.seq_id}, seq {child.seq_id})", self.lab.fork, parent, child)
        group = self.group_of[parent.seq_id]
        group.add(child)
        self.group_of[child.seq_id] = group
        self.compare()
        return child

    def free(self, seq: Sequence) -> None:
        """`seq` finished: both managers release its blocks; a second free is a no-op."""
        self.log.append(f"free seq {seq.seq_id}")
        self.ref.free(seq)
        self._call(f"free(seq {seq.seq_id})", self.lab.free, seq)
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.compare()
        self.log.append(f"free seq {seq.seq_id} again (a no-op)")
        self._call(f"free(seq {seq.seq_id}) a second time", self.lab.free, seq)
        self.compare()
        group = self.group_of[seq.seq_id]
        if group.is_finished():
            self.groups.remove(group)

    def swap_out(self, group: SequenceGroup) -> None:
        if not self.ref.can_swap_out(group):
            return
        self.log.append(f"swap out request {group.request_id}")
        expected = self.ref.swap_out(group)
        got = self._call("swap_out", self.lab.swap_out, group)
        self._expect(len(got) == len(expected), f"swap_out moved {len(got)} blocks, expected {len(expected)}")
        group.set_status(SequenceStatus.SWAPPED)
        self.compare()

    def swap_in(self, group: SequenceGroup) -> None:
        if self.ref.can_swap_in(group) != AllocStatus.OK:
            return
        self.log.append(f"swap in request {group.request_id}")
        expected = self.ref.swap_in(group)
        got = self._call("swap_in", self.lab.swap_in, group)
        self._expect(len(got) == len(expected), f"swap_in moved {len(got)} blocks, expected {len(expected)}")
        group.set_status(SequenceStatus.RUNNING)
        self.compare()

    def recompute(self, group: SequenceGroup) -> None:
        """Preemption by recompute of a one-sequence request: free, then prefill prompt + outputs."""
        (seq,) = group.get_seqs(status=SequenceStatus.RUNNING)
        self.log.append(f"preempt request {group.request_id} by recompute: free seq {seq.seq_id}")
        self.ref.free(seq)
        self._call(f"free(seq {seq.seq_id})", self.lab.free, seq)
        seq.reset_state_for_recompute()
        seq.status = SequenceStatus.WAITING
        self.groups.remove(group)
        self.compare()
        self._prefill(group, f"allocate request {group.request_id} again ({seq.get_len()} tokens)")

    # ------------------------------------------------------------------ internals
    def _prefill(self, group: SequenceGroup, what: str) -> bool:
        if self.ref.can_allocate(group) != AllocStatus.OK:
            return False
        self.log.append(what)
        seq = group.get_seqs(status=SequenceStatus.WAITING)[0]
        cached = self.ref.get_num_cached_tokens(seq)
        if self.caching:
            got = self._call("get_num_cached_tokens (before allocate)", self.lab.get_num_cached_tokens, seq)
            self._expect(got == cached, f"before allocate, get_num_cached_tokens(seq {seq.seq_id}) is {got}: "
                         f"the prefix cache should find {cached} tokens ({cached // self.block_size} blocks)")
        self.ref.allocate(group)
        self._call(f"allocate(request {group.request_id})", self.lab.allocate, group)
        group.set_status(SequenceStatus.RUNNING)
        for s in group.get_seqs():
            s.data.num_computed_tokens = cached
            self.group_of[s.seq_id] = group
        self._mark_computed(group, seq.get_len() - cached)
        group.update_num_computed_tokens(seq.get_len() - cached)
        self.groups.append(group)
        self.compare()
        return True

    def _mark_computed(self, group: SequenceGroup, chunk: int) -> None:
        # As the scheduler does right after scheduling the chunk (caching off: nothing happens).
        self.ref.mark_blocks_as_computed(group, chunk)
        self._call("mark_blocks_as_computed", self.lab.mark_blocks_as_computed, group, chunk)

    def _call(self, what: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (NotImplementedError, LabCheckFailed):
            raise
        except Exception as exc:
            self._fail(f"{what} raised {type(exc).__name__}: {exc}")

    def compare(self) -> None:
        expected, got = manager_state(self.ref, self.caching), manager_state(self.lab, self.caching)
        for key, value in expected.items():
            self._expect(got[key] == value, f"{key}: {_difference(value, got[key])}")

    def _expect(self, ok: bool, message: str) -> None:
        if not ok:
            self._fail(message)

    def _fail(self, message: str) -> None:
        raise LabCheckFailed(f"{self.case}, after\n{format_steps(self.log)}\n{message}\n(expected: minivllm's "
                             f"BlockSpaceManager on the same calls; blocks labelled G0, G1, ... / C0, ... "
                             f"in order of first appearance, so block numbers may differ)")

    def running(self) -> list[SequenceGroup]:
        return [g for g in self.groups if g.get_seqs(status=SequenceStatus.RUNNING)]

    def swapped(self) -> list[SequenceGroup]:
        return [g for g in self.groups if g.get_seqs(status=SequenceStatus.SWAPPED)]


def format_steps(log: list[str]) -> str:
    """The last operations of `log`, numbered, one a line."""
    shown = log[-NUM_FAILING_OPS_SHOWN:]
    return "\n".join(f"  {i}. {op}" for i, op in enumerate(shown, len(log) - len(shown) + 1))


def _difference(expected, got) -> str:
    """`expected X, got Y`; for two dicts only the entries that differ (seq ids, block labels)."""
    if not (isinstance(expected, dict) and isinstance(got, dict)):
        return f"expected {expected}, got {got}"
    keys = [k for k in sorted(set(expected) | set(got), key=str) if expected.get(k) != got.get(k)]
    shown = "; ".join(f"{k}: expected {expected.get(k, '(none)')}, got {got.get(k, '(none)')}"
                      for k in keys[:NUM_FAILING_OPS_SHOWN])
    more = f"; ... {len(keys) - NUM_FAILING_OPS_SHOWN} more" if len(keys) > NUM_FAILING_OPS_SHOWN else ""
    return f"{shown}{more} (in all: expected {expected}, got {got})"


def _ids(seqs) -> str:
    return ", ".join(str(s.seq_id) for s in seqs)


def _short(tokens: list[int]) -> str:
    return str(tokens) if len(tokens) <= 12 else f"[{', '.join(map(str, tokens[:10]))}, ... {len(tokens)} tokens]"


def random_prompt(rng: random.Random) -> list[int]:
    head = HEADS[rng.randrange(len(HEADS))][:rng.randint(0, 12)]
    return (head + [rng.randint(1, 4) for _ in range(rng.randint(0, 8))]) or [1]


ALL_OPERATIONS = ("add", "append", "fork", "free", "swap", "recompute")


def random_operations(twin: Twin, rng: random.Random, num_ops: int, ops: tuple[str, ...] = ALL_OPERATIONS) -> None:
    """Random requests, decode steps, forks, frees, swaps and recomputes (those named in `ops`),
    as an engine interleaves them (multi-sequence requests swap, one-sequence requests may
    recompute)."""
    weights = {"add": 2, "append": 3, "fork": 1, "free": 1, "swap": 1, "recompute": 1}
    choices = [op for op in ops for _ in range(weights[op])]
    for _ in range(num_ops):
        op = rng.choice(choices)
        running, swapped = twin.running(), twin.swapped()
        if op == "add" or not twin.groups:
            twin.add(random_prompt(rng), num_seqs=1 if rng.random() < 0.85 else 2)
        elif op == "append" and running:
            twin.append(rng.choice(running), rng)
        elif op == "fork" and running:
            group = rng.choice(running)
            if group.num_seqs() < 4:
                twin.fork(rng.choice(group.get_seqs(status=SequenceStatus.RUNNING)))
        elif op == "free":
            group = rng.choice(twin.groups)
            twin.free(rng.choice(group.get_unfinished_seqs()))
        elif op == "swap":
            if swapped and (rng.random() < 0.5 or not running):
                twin.swap_in(rng.choice(swapped))
            elif running:
                twin.swap_out(rng.choice(running))
        elif op == "recompute":
            singles = [g for g in running if g.num_seqs(status=SequenceStatus.RUNNING) == 1
                       and g.num_seqs() == 1]
            if singles:
                twin.recompute(rng.choice(singles))


def random_twins(manager_cls: type, ops: tuple[str, ...], enable_caching: bool = False,
                 num_sequences: int = NUM_RANDOM_SEQUENCES) -> None:
    for seed in range(num_sequences):
        rng = random.Random(seed)
        twin = Twin(manager_cls, f"random sequence {seed}" + (" (caching on)" if enable_caching else ""),
                    block_size=rng.choice((1, 2, 4)), num_gpu_blocks=rng.randint(4, 16),
                    num_cpu_blocks=rng.randint(0, 8), enable_caching=enable_caching)
        random_operations(twin, rng, NUM_RANDOM_OPS, ops)


# ============================================================================ the manager
def check_allocate_and_free(manager_cls: type) -> None:
    """`allocate` and `free` of `manager_cls` against `BlockSpaceManager` (block_size 4, 8 GPU blocks)."""
    twin = Twin(manager_cls, "case 'allocate a 6-token prompt: 2 blocks of 4 tokens'")
    group = twin.add([1, 2, 3, 4, 5, 6])
    twin.case = "case 'allocate a request of two waiting sequences: one table, each block's ref_count 2'"
    pair = twin.add([1, 2, 3, 4, 5], num_seqs=2)
    twin.case = "case 'free: a block goes back when no table holds it; freeing twice is a no-op'"
    twin.free(group.first_seq)
    for seq in pair.get_seqs():
        twin.free(seq)
    twin.case = "case 'allocate 9-token prompts until the pool is full'"
    while twin.add(list(range(1, 10))) is not None:
        pass
    passed("allocate and free: one table per request, ref counts, blocks back in the pool")
    random_twins(manager_cls, ("add", "free"))
    passed(f"{NUM_RANDOM_SEQUENCES} random sequences of allocate / free: same tables, ref counts and free blocks")


def check_append_slots(manager_cls: type) -> None:
    """`append_slots` (no forks yet: never a copy) with your `allocate` and `free`."""
    twin = Twin(manager_cls, "case 'append_slots: tokens 7 and 8 fill the last block, token 9 needs a new one'")
    group = twin.add([1, 2, 3, 4, 5, 6])
    for _ in range(3):
        twin.append(group)
    twin.case = "case 'append_slots after a prompt of exactly one full block'"
    twin.append(twin.add([1, 2, 3, 4]))
    twin.case = "case 'preempt by recompute: free, then allocate prompt and outputs again'"
    twin.recompute(group)
    passed("append_slots: the next slot in the last block, a new block when it is full")
    random_twins(manager_cls, ("add", "append", "free", "recompute"))
    passed(f"{NUM_RANDOM_SEQUENCES} random sequences of allocate / append_slots / free / recompute")


def check_block_manager(manager_cls: type) -> None:
    """allocate / append_slots / fork / free of `manager_cls` on focused cases, then on random
    operation sequences, against `BlockSpaceManager` (inherited methods included)."""
    twin = Twin(manager_cls, "case 'fork: the child shares every block'")
    group = twin.add([1, 2, 3, 4, 5, 6])
    seq = group.first_seq
    for _ in range(3):
        twin.append(group)
    child = twin.fork(seq)
    twin.case = "case 'copy-on-write: the first writer copies the shared last block, the last sharer writes in place'"
    twin.append(group)
    twin.append(group)
    expect(twin.num_copies == 1, f"{twin.case}: {twin.num_copies} copy-on-write pairs in all, expected 1")
    twin.case = "case 'free: a shared block returns to the pool only when its last holder frees it'"
    twin.free(child)
    twin.free(seq)
    passed("fork, copy-on-write, free of shared blocks")

    twin = Twin(manager_cls, "case 'allocate a request of two waiting sequences: one table, ref_count 2'")
    group = twin.add([1, 2, 3, 4, 5], num_seqs=2)
    twin.case = "case 'decode a request of two sequences: the first copies, the second writes in place'"
    twin.append(group)
    for seq in group.get_seqs():
        twin.free(seq)
    twin = Twin(manager_cls, "case 'swap out a forked request and back in'", num_gpu_blocks=6)
    group = twin.add([1, 2, 3, 4, 5, 6])
    twin.fork(group.first_seq)
    twin.append(group)
    twin.swap_out(group)
    twin.swap_in(group)
    twin.append(group)
    expect(twin.ref.get_num_free_cpu_blocks() == 4 and group.first_seq.status == SequenceStatus.RUNNING,
           f"{twin.case}: the request did not swap out and back in (the check's pool is too small)")
    passed("a request of two sequences; swap out and in (inherited, with your allocator)")

    random_twins(manager_cls, ALL_OPERATIONS)
    passed(f"{NUM_RANDOM_SEQUENCES} random sequences of {NUM_RANDOM_OPS} operations: "
           "same tables, ref counts and free blocks as minivllm's BlockSpaceManager")


# ============================================================================ in the engine
def counting(manager_cls: type) -> type:
    """`manager_cls` that records its instances and counts copy-on-write pairs (the check's
    window into the engine's block manager)."""

    class Counting(manager_cls):
        instances: list = []

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.num_copies = 0
            Counting.instances.append(self)

        def append_slots(self, seq, num_lookahead_slots: int = 0):
            pairs = super().append_slots(seq, num_lookahead_slots)
            self.num_copies += len(pairs)
            return pairs

    Counting.__name__ = Counting.__qualname__ = f"Counting{manager_cls.__name__}"
    return Counting


def assert_all_blocks_free(llm: LLM, what: str) -> None:
    bm = llm.llm_engine.scheduler.block_manager
    cache = llm.llm_engine.cache_config
    expect(not bm.block_tables, f"{what}: every request finished, yet sequences "
           f"{sorted(bm.block_tables)} still have block tables (free() must drop them)")
    expect(bm.get_num_free_gpu_blocks() == cache.num_gpu_blocks,
           f"{what}: every request finished, yet {bm.get_num_free_gpu_blocks()} of {cache.num_gpu_blocks} "
           "GPU blocks are free: a block's ref_count never went back to 0")
    expect(bm.get_num_free_cpu_blocks() == (cache.num_cpu_blocks or 0),
           f"{what}: {bm.get_num_free_cpu_blocks()} of {cache.num_cpu_blocks} CPU blocks are free at the end")


def check_block_manager_in_engine(manager_cls: type, max_tokens: int = 16) -> None:
    """Your class as the engine's `block_manager_cls`: greedy output equal to transformers under
    recompute and swap preemption (a pool of 8 blocks of 8 tokens), then `n=2` samples that fork
    and copy on write, equal to the same seeded run on minivllm's own manager."""
    small = dict(block_size=8, num_gpu_blocks_override=8, max_model_len=128)
    for mode in ("recompute", "swap"):
        cls = counting(manager_cls)
        llm = LLM(**device_kwargs(block_manager_cls=cls, preemption_mode=mode, **small))
        assert_greedy_matches_transformers(PROMPTS, max_tokens, llm=llm)
        preemptions = llm.llm_engine.scheduler.num_cumulative_preemption
        expect(preemptions > 0, f"preemption by {mode}: the small pool preempted nothing, so this run proves "
               "nothing about it (the check's engine settings are too generous)")
        assert_all_blocks_free(llm, f"preemption by {mode}")
        passed(f"preemption by {mode}: {preemptions} preemptions, every block back in the pool")

    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = {}
    for name, cls in (("minivllm's BlockSpaceManager", BlockSpaceManager), ("yours", counting(manager_cls))):
        llm = LLM(**device_kwargs(block_manager_cls=cls))
        with stall_guard(llm):
            results = llm.generate(list(PROMPTS), params, use_tqdm=False)
        outputs[name] = [[list(c.token_ids) for c in r.outputs] for r in results]
        assert_all_blocks_free(llm, f"n=2 sampling with {name}")
    num_copies = cls.instances[-1].num_copies
    expect(num_copies > 0, "n=2 sampling: append_slots returned no copy-on-write pair, yet two samples "
           "of one prompt shared a partly filled last block")
    for index, (want, got) in enumerate(zip(*outputs.values())):
        expect(got == want, f"n=2 sampling, prompt {index}: your samples {got} differ from the same seeded "
               f"run on minivllm's BlockSpaceManager {want}: a sample read another one's KV")
    passed(f"n=2 sampling: {num_copies} copy-on-write copies, samples equal to minivllm's block manager, "
           "every block back in the pool")
