"""Random interleavings of allocate / append / fork / free / swap / recompute, checked after
every step against invariants and against a shadow KV cache.

The shadow cache is the reference: a "worker" writes, into each slot a block table names,
the causal prefix its token's K/V depends on (tokens[:t+1]), applies the copy-on-write and
swap mappings the manager returns, and then every sequence must read back exactly its own
history. A wrong block table, a missed copy-on-write, or a cached block with other content
shows up as a wrong read, whatever the manager believes about itself.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.core.block_manager import AllocStatus, BlockSpaceManager, OutOfBlocksError
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

# Prompts are drawn from a few shared "system prompts" plus a random tail, so identical
# full blocks (prefix-cache hits) and near misses (same tokens, other prefix) both occur.
SYSTEM_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4]]
VOCAB = st.integers(min_value=1, max_value=4)  # a tiny vocabulary makes equal blocks likely
MAX_SEQS_PER_GROUP = 4


class BlockManagerMachine(RuleBasedStateMachine):
    enable_caching = False

    @initialize(block_size=st.integers(1, 8), num_gpu_blocks=st.integers(1, 16),
                num_cpu_blocks=st.integers(0, 12), watermark=st.sampled_from([0.0, 0.1, 0.25]))
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, watermark):
        self.bm = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                                    enable_caching=self.enable_caching)
        self.block_size = block_size
        self.groups: list[SequenceGroup] = []  # unfinished requests holding blocks
        self.seq_ids = itertools.count()
        self.request_ids = itertools.count()
        self.gpu_mem: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix
        self.cpu_mem: dict[tuple[int, int], tuple[int, ...]] = {}

    # ------------------------------------------------------------ the "worker"
    def slot(self, table: list[int], t: int) -> tuple[int, int]:
        return table[t // self.block_size], t % self.block_size

    def write(self, seq: Sequence, t: int) -> None:
        """Store token t's K/V; only an exclusively held, uncached GPU block may be written."""
        block = self.bm.block_tables[seq.seq_id][t // self.block_size]
        assert block.ref_count == 1, "a write into a shared block would leak into another sequence"
        assert not self.bm.gpu_allocator.is_cached(block), "a cached block must never be written"
        self.gpu_mem[self.slot(self.bm.get_block_table(seq), t)] = tuple(seq.get_token_ids()[: t + 1])

    def copy(self, mapping, src_mem, dst_mem) -> None:
        for src, dst in mapping:
            for offset in range(self.block_size):
                if (src, offset) in src_mem:
                    dst_mem[(dst, offset)] = src_mem[(src, offset)]
                else:
                    dst_mem.pop((dst, offset), None)

    def running(self):
        return [g for g in self.groups if g.get_seqs(SequenceStatus.RUNNING)]

    def swapped(self):
        return [g for g in self.groups if g.get_seqs(SequenceStatus.SWAPPED)]

    # ------------------------------------------------------------------ rules
    @rule(system=st.integers(0, len(SYSTEM_PROMPTS) - 1), cut=st.integers(0, 12),
          tail=st.lists(VOCAB, max_size=10), mark=st.booleans())
    def add_request(self, system, cut, tail, mark):
        prompt = SYSTEM_PROMPTS[system][:cut] + tail or [1]
        seq = Sequence(next(self.seq_ids), None, prompt, self.block_size)
        group = SequenceGroup(str(next(self.request_ids)), [seq], arrival_time=0.0)
        self.prefill(group, mark)

    @rule(system=st.integers(0, len(SYSTEM_PROMPTS) - 1), cut=st.integers(0, 12),
          tail=st.lists(VOCAB, max_size=10), seq_block_size=st.integers(1, 32), mark=st.booleans())
    def add_request_with_another_block_size(self, system, cut, tail, seq_block_size, mark):
        """The manager's block size is the only one that counts blocks: a Sequence built with
        another one is served like any other (every check below counts the manager's blocks)."""
        prompt = SYSTEM_PROMPTS[system][:cut] + tail or [1]
        seq = Sequence(next(self.seq_ids), None, prompt, seq_block_size)
        group = SequenceGroup(str(next(self.request_ids)), [seq], arrival_time=0.0)
        self.prefill(group, mark)

    def num_blocks(self, seq: Sequence) -> int:
        """Blocks that hold every token of `seq`, in the manager's block size."""
        return -(-seq.get_len() // self.block_size)

    def prefill(self, group: SequenceGroup, mark: bool) -> None:
        seq = group.first_seq
        status = self.bm.can_allocate(group)
        usable = self.bm.num_total_gpu_blocks - self.bm.watermark_blocks
        assert (status == AllocStatus.NEVER) == (self.num_blocks(seq) > usable)
        if status != AllocStatus.OK:
            assert status == AllocStatus.NEVER or (
                self.bm.get_num_free_gpu_blocks() - self.num_blocks(seq) < self.bm.watermark_blocks)
            return
        cached = self.bm.get_num_cached_tokens(seq)
        assert cached % self.block_size == 0 and cached < seq.get_len()
        assert cached == 0 or self.enable_caching
        self.bm.allocate(group)
        assert self.bm.get_num_cached_tokens(seq) == cached
        group.set_status(SequenceStatus.RUNNING)
        table = self.bm.get_block_table(seq)
        for t in range(cached):  # the reused prefix must already hold exactly our K/V
            assert self.gpu_mem.get(self.slot(table, t)) == tuple(seq.get_token_ids()[: t + 1])
        for t in range(cached, seq.get_len()):
            self.write(seq, t)
        seq.data.num_computed_tokens = cached
        chunk = seq.get_len() - cached
        if mark:  # as the scheduler does right after scheduling the chunk
            self.bm.mark_blocks_as_computed(group, token_chunk_size=chunk)
        group.update_num_computed_tokens(chunk)
        self.groups.append(group)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), mark=st.booleans())
    def decode(self, data, mark):
        group = data.draw(st.sampled_from(self.running()))
        if not self.bm.can_append_slots(group):
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.append_token_id(data.draw(VOCAB), {})
            before = {b.block_number: b.ref_count for b in self.bm.block_tables[seq.seq_id]}
            cows = self.bm.append_slots(seq)
            assert len(cows) <= 1
            for src, dst in cows:  # vLLM's copy-on-write: shared last block -> fresh copy
                assert before[src] > 1 and self.bm.get_block_table(seq)[-1] == dst
            self.copy(cows, self.gpu_mem, self.gpu_mem)
            self.write(seq, seq.get_len() - 1)
        if mark:
            self.bm.mark_blocks_as_computed(group, token_chunk_size=1)
        group.update_num_computed_tokens(1)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data):
        group = data.draw(st.sampled_from(self.running()))
        if group.num_seqs() >= MAX_SEQS_PER_GROUP:
            return
        parent = data.draw(st.sampled_from(group.get_seqs(SequenceStatus.RUNNING)))
        child = parent.fork(next(self.seq_ids))
        self.bm.fork(parent, child)
        group.add(child)
        assert self.bm.get_block_table(child) == self.bm.get_block_table(parent)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free_seq(self, data):
        group = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(group.get_unfinished_seqs()))
        table = self.bm.block_tables[seq.seq_id]
        allocator = self.bm.gpu_allocator if seq.status == SequenceStatus.RUNNING else self.bm.cpu_allocator
        refs = {b.block_number: b.ref_count for b in table}
        free_before = allocator.get_num_free_blocks()
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED_STOPPED
        # Every block it held lost exactly one holder; the ones it held alone came back.
        for block in table:
            assert block.ref_count == refs[block.block_number] - 1
        assert allocator.get_num_free_blocks() == free_before + sum(r == 1 for r in refs.values())
        self.bm.free(seq)  # freeing twice is a no-op
        if group.is_finished():
            self.groups.remove(group)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self.running()))
        free_cpu = self.bm.get_num_free_cpu_blocks()
        if not self.bm.can_swap_out(group):
            try:
                self.bm.swap_out(group)
            except OutOfBlocksError:
                return
            raise AssertionError("swap_out without room must raise")
        mapping = self.bm.swap_out(group)
        assert len({g for g, _ in mapping}) == len({c for _, c in mapping}) == len(mapping)
        assert self.bm.get_num_free_cpu_blocks() == free_cpu - len(mapping)
        self.copy(mapping, self.gpu_mem, self.cpu_mem)
        group.set_status(SequenceStatus.SWAPPED)

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.swapped()))
        status = self.bm.can_swap_in(group)
        num_blocks = len({b for s in group.get_seqs(SequenceStatus.SWAPPED) for b in self.bm.get_block_table(s)})
        assert (status == AllocStatus.NEVER) == (
            num_blocks + group.num_seqs(SequenceStatus.SWAPPED) > self.bm.num_total_gpu_blocks)
        if status != AllocStatus.OK:
            if num_blocks > self.bm.get_num_free_gpu_blocks():  # no room: must refuse, untouched
                free_gpu = self.bm.get_num_free_gpu_blocks()
                try:
                    self.bm.swap_in(group)
                except OutOfBlocksError:
                    assert self.bm.get_num_free_gpu_blocks() == free_gpu
                    return
                raise AssertionError("swap_in without room must raise")
            return
        free_cpu = self.bm.get_num_free_cpu_blocks()
        mapping = self.bm.swap_in(group)
        assert self.bm.get_num_free_cpu_blocks() == free_cpu + num_blocks  # every CPU block released
        self.copy(mapping, self.cpu_mem, self.gpu_mem)
        group.set_status(SequenceStatus.RUNNING)

    @precondition(lambda self: any(g.num_seqs() == 1 for g in self.running()))
    @rule(data=st.data(), mark=st.booleans())
    def preempt_by_recompute(self, data, mark):
        """Drop the cache of a one-sequence request and prefill prompt + outputs again."""
        group = data.draw(st.sampled_from([g for g in self.running() if g.num_seqs() == 1]))
        seq = group.first_seq
        self.bm.free(seq)
        seq.reset_state_for_recompute()
        seq.status = SequenceStatus.WAITING
        self.groups.remove(group)
        self.prefill(group, mark)

    # ------------------------------------------------------------- invariants
    @invariant()
    def pools_add_up(self):
        tables = list(self.bm.block_tables.values())
        for allocator in (self.bm.gpu_allocator, self.bm.cpu_allocator):
            free = set(allocator.free_block_ids)
            evictable = set(allocator.evictor)
            referenced = {b.block_number for b in allocator.blocks if b.ref_count > 0}
            assert len(free) == len(allocator.free_block_ids), "a block is twice on the free list"
            assert not (free & evictable) and not (free & referenced) and not (evictable & referenced)
            assert len(free) + len(referenced) + len(evictable) == allocator.num_blocks
            # Each reference count equals the number of block tables that hold the block.
            holders = {b.block_number: 0 for b in allocator.blocks}
            for table in tables:
                for block in table:
                    if block.device is allocator.device:
                        assert allocator.blocks[block.block_number] is block
                        holders[block.block_number] += 1
            assert holders == {b.block_number: b.ref_count for b in allocator.blocks}

    @invariant()
    def every_sequence_reads_its_own_history(self):
        for group in getattr(self, "groups", []):
            for seq in group.get_unfinished_seqs():
                table = self.bm.get_block_table(seq)
                assert len(table) == self.num_blocks(seq)
                on_gpu = seq.status == SequenceStatus.RUNNING
                allocator = self.bm.gpu_allocator if on_gpu else self.bm.cpu_allocator
                assert all(b.device is allocator.device for b in self.bm.block_tables[seq.seq_id])
                mem = self.gpu_mem if on_gpu else self.cpu_mem
                for t in range(seq.get_num_computed_tokens()):
                    assert mem.get(self.slot(table, t)) == tuple(seq.get_token_ids()[: t + 1])

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        if not hasattr(self, "bm"):
            return
        for block_hash, block in self.bm.gpu_allocator.cached_blocks.items():
            assert block.block_hash == block_hash
            # A cached block's K/V is exactly that of its chain (its whole prefix).
            for offset in range(self.block_size):
                prefix = self.gpu_mem.get((block.block_number, offset))
                assert prefix is not None
                assert len(prefix) == block.num_hashed_tokens - self.block_size + offset + 1
                assert prefix[-(offset + 1):] == block.token_ids[: offset + 1]
        if not self.enable_caching:
            assert not self.bm.gpu_allocator.cached_blocks and not self.bm.gpu_allocator.evictor


class BlockManagerWithCachingMachine(BlockManagerMachine):
    enable_caching = True


# 2 variants x 100 examples x 25 steps: ~5,000 random steps in a few seconds.
_SETTINGS = settings(max_examples=100, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _SETTINGS
TestBlockManagerWithCachingStateful = BlockManagerWithCachingMachine.TestCase
TestBlockManagerWithCachingStateful.settings = _SETTINGS
