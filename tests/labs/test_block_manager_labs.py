"""The checks of labs 01 (block allocator, block manager) and 02 (prefix caching) pass on the
package's own classes and fail, with a message naming the fault, on each deliberately wrong
implementation below (one fault each): a check that cannot fail checks nothing."""

from __future__ import annotations

import pytest

from minivllm.core.block_allocator import BlockAllocator, Device
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.core.prefix_caching import NoPrefixCache, PrefixCache, hash_block_tokens
from minivllm.labs import LabCheckFailed
from minivllm.labs.block_manager import (check_allocate_and_free, check_append_slots, check_block_allocator,
                                         check_block_manager, check_block_manager_in_engine)
from minivllm.labs.prefix_caching import (check_hash_block_tokens, check_lru_allocator, check_prefix_cache,
                                          check_prefix_caching_in_engine, check_prefix_caching_manager)
from minivllm.sequence import SequenceStatus


def with_parts(allocator_cls=BlockAllocator, cache_cls=PrefixCache) -> type:
    """A `BlockSpaceManager` whose pools are `allocator_cls` and whose prefix cache is `cache_cls`."""

    class Manager(BlockSpaceManager):
        def __init__(self, block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.01, enable_caching=False):
            super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark, enable_caching)
            self.gpu_allocator = allocator_cls(Device.GPU, block_size, num_gpu_blocks, enable_caching)
            self.cpu_allocator = allocator_cls(Device.CPU, block_size, num_cpu_blocks, False)
            self.prefix_cache = (cache_cls if enable_caching else NoPrefixCache)(self.gpu_allocator, block_size)

    return Manager


# ------------------------------------------------------------------ wrong allocators (lab 01)
class FreeWithoutRefCount(BlockAllocator):
    """Every free returns the block to the pool, however many tables still hold it."""

    def free(self, block, now):
        if block.ref_count <= 0:
            raise ValueError("double free")
        block.ref_count = 0
        block.forget_content()
        self.free_block_ids.append(block.block_number)


class RefCountNotDecremented(BlockAllocator):
    """free forgets to drop the count: no block ever comes back."""

    def free(self, block, now):
        if block.ref_count <= 0:
            raise ValueError("double free")


class NoDoubleFreeCheck(BlockAllocator):
    def free(self, block, now):
        if block.ref_count == 0:
            return
        super().free(block, now)


class AllocateWithoutRefCount(BlockAllocator):
    def allocate(self, now):
        block = super().allocate(now)
        block.ref_count = 0
        return block


class IncrefByOne(BlockAllocator):
    """incref ignores `count`."""

    def incref(self, block, count, now):
        super().incref(block, 1, now)


class LifoFreeList(BlockAllocator):
    """Right, only another hand-out order: the checks compare up to block numbering."""

    def free(self, block, now):
        super().free(block, now)
        if self.free_block_ids and self.free_block_ids[-1] == block.block_number:
            self.free_block_ids.appendleft(self.free_block_ids.pop())


# ------------------------------------------------------------------ wrong managers (lab 01)
class CopyOnWriteSkipped(BlockSpaceManager):
    """Writes into a shared last block in place: samples read each other's tokens."""

    def append_slots(self, seq, num_lookahead_slots=0):
        table = self.block_tables[seq.seq_id]
        while len(table) < -(-(seq.get_len() + num_lookahead_slots) // self.block_size):
            table.append(self.gpu_allocator.allocate(self._tick()))
        return []


class CopyWithoutFreeingTheShared(BlockSpaceManager):
    """Copies, but the shared block keeps the writer's reference (a leak)."""

    def append_slots(self, seq, num_lookahead_slots=0):
        table = self.block_tables[seq.seq_id]
        index = (seq.get_len() - 1) // self.block_size
        shared = table[index] if index < len(table) else None
        pairs = super().append_slots(seq, num_lookahead_slots)
        if pairs:
            shared.ref_count += 1
        return pairs


class AppendAlwaysANewBlock(BlockSpaceManager):
    """Starts a new block for every token, whether the last one is full or not."""

    def append_slots(self, seq, num_lookahead_slots=0):
        self.block_tables[seq.seq_id].append(self.gpu_allocator.allocate(self._tick()))
        return []


class AppendNeverGrows(BlockSpaceManager):
    """Never adds a block: the token after a full block has no slot."""

    def append_slots(self, seq, num_lookahead_slots=0):
        return []


class ForkWithoutIncref(BlockSpaceManager):
    def fork(self, parent_seq, child_seq):
        self.block_tables[child_seq.seq_id] = list(self.block_tables[parent_seq.seq_id])


class FreeThroughTheGpuPoolOnly(BlockSpaceManager):
    """Frees a swapped-out sequence's CPU blocks into the GPU pool."""

    def free(self, seq):
        for block in self.block_tables.pop(seq.seq_id, []):
            self.gpu_allocator.free(block, self._tick())


class TablePerWaitingSequence(BlockSpaceManager):
    """A request of two waiting sequences gets two copies of the prompt's blocks."""

    def allocate(self, seq_group):
        now = self._tick()
        for seq in seq_group.get_seqs(status=SequenceStatus.WAITING):
            self.block_tables[seq.seq_id] = [self.gpu_allocator.allocate(now)
                                             for _ in range(self.get_num_required_blocks(seq))]
            self._num_cached_tokens[seq.seq_id] = 0


class FreeOfUnknownSequenceRaises(BlockSpaceManager):
    def free(self, seq):
        for block in self.block_tables.pop(seq.seq_id):
            self._allocator(block).free(block, self._tick())


# ------------------------------------------------------------------ wrong hashes (lab 02)
def unchained_hash(parent_block_hash, token_ids, extra_hash=0):
    return hash((tuple(token_ids), extra_hash))


def hash_without_lora(parent_block_hash, token_ids, extra_hash=0):
    return hash((parent_block_hash, tuple(token_ids)))


def hash_of_the_token_sum(parent_block_hash, token_ids, extra_hash=0):
    return hash((parent_block_hash, sum(token_ids), extra_hash))


# ------------------------------------------------------------------ wrong evictors (lab 02)
class ForgetsCachedBlocksOnFree(BlockAllocator):
    """A freed cached block goes to the free list: the cache keeps nothing no table holds."""

    def free(self, block, now):
        super().free(block, now)
        if block.ref_count == 0 and block.block_number in self.evictor:
            del self.evictor[block.block_number]
            self.uncache(block)
            self.free_block_ids.append(block.block_number)


class EvictsMostRecentlyUsed(BlockAllocator):
    @staticmethod
    def _eviction_order(block):
        return -block.last_accessed, -block.num_hashed_tokens


class EvictsShallowestFirst(BlockAllocator):
    @staticmethod
    def _eviction_order(block):
        return block.last_accessed, block.num_hashed_tokens


class IncrefWithoutRevive(BlockAllocator):
    """A cache hit on an evictable block leaves it in the evictor: it is handed out while held."""

    def incref(self, block, count, now):
        block.ref_count += count
        block.last_accessed = now


class EvictKeepsTheHash(BlockAllocator):
    """The evicted block stays in `cached_blocks`: a lookup finds a block now holding other tokens."""

    def _evict(self):
        victim = min(self.evictor.values(), key=self._eviction_order)
        del self.evictor[victim.block_number]
        return victim


class FreeEvictableCountsOnlyTheFreeList(BlockAllocator):
    def get_num_free_blocks(self):
        return len(self.free_block_ids)


# ------------------------------------------------------------------ wrong prefix caches (lab 02)
class FindsTheLastTokensBlock(PrefixCache):
    def _num_candidates(self, seq):
        return seq.get_len() // self.block_size


class RegistersUncomputedBlocks(PrefixCache):
    def register(self, seq, block_table, num_computed_tokens):
        super().register(seq, block_table, seq.get_len())


class UnchainedPrefixCache(PrefixCache):
    """find and register hash each block alone (the package's code with `unchained_hash`)."""

    def find(self, seq):
        size, blocks = self.block_size, []
        for i in range(self._num_candidates(seq)):
            tokens = tuple(seq.get_token_ids()[i * size:(i + 1) * size])
            block = self.gpu_allocator.lookup(unchained_hash(None, tokens, seq.lora_int_id), tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, seq, block_table, num_computed_tokens):
        size = self.block_size
        for i in range(num_computed_tokens // size):
            block = block_table[i]
            if block.block_hash is None and block.device is Device.GPU:
                tokens = tuple(seq.get_token_ids()[i * size:(i + 1) * size])
                block_hash = unchained_hash(None, tokens, seq.lora_int_id)
                self.gpu_allocator.register(block, block_hash, tokens, (i + 1) * size)


class NeverFinds(PrefixCache):
    def find(self, seq):
        return []


# ------------------------------------------------------------------ the tests
def test_the_package_passes_the_unit_checks(capsys):
    check_block_allocator(BlockAllocator)
    check_allocate_and_free(BlockSpaceManager)
    check_append_slots(BlockSpaceManager)
    check_block_manager(BlockSpaceManager)
    check_block_allocator(LifoFreeList)
    check_block_manager(with_parts(LifoFreeList))
    check_hash_block_tokens(hash_block_tokens)
    check_lru_allocator(BlockAllocator)
    check_prefix_cache(PrefixCache)
    check_prefix_caching_manager(BlockSpaceManager)
    check_prefix_caching_manager(with_parts(LifoFreeList))
    assert capsys.readouterr().out.count("✓") >= 16


@pytest.mark.slow
def test_the_package_passes_the_engine_checks(capsys):
    check_block_manager_in_engine(BlockSpaceManager)
    check_prefix_caching_in_engine(BlockSpaceManager)
    out = capsys.readouterr().out
    assert "preemption by recompute" in out and "preemption by swap" in out and "copy-on-write copies" in out
    assert "hit rate" in out and "evictions" in out


WRONG = [
    (check_block_allocator, FreeWithoutRefCount, "ref_count"),
    (check_block_allocator, RefCountNotDecremented, "ref_count"),
    (check_block_allocator, NoDoubleFreeCheck, "double free"),
    (check_block_allocator, AllocateWithoutRefCount, "ref_count is 0, expected 1"),
    (check_block_allocator, IncrefByOne, "expected 3"),
    (check_allocate_and_free, with_parts(FreeWithoutRefCount), "free seq 1\\nref counts"),
    (check_allocate_and_free, TablePerWaitingSequence, "two waiting sequences"),
    (check_allocate_and_free, FreeOfUnknownSequenceRaises, "a second time raised KeyError"),
    (check_append_slots, AppendAlwaysANewBlock, "fill the last block"),
    (check_append_slots, AppendNeverGrows, "token 9 needs a new one"),
    (check_block_manager, with_parts(FreeWithoutRefCount), "raised ValueError: double free"),
    (check_block_manager, CopyOnWriteSkipped, "copy-on-write pair"),
    (check_block_manager, CopyWithoutFreeingTheShared, "expected 0 copy-on-write pair"),
    (check_block_manager, ForkWithoutIncref, "fork seq"),
    (check_block_manager, FreeThroughTheGpuPoolOnly, "free seq"),
    (check_block_manager, TablePerWaitingSequence, "two waiting sequences"),
    (check_block_manager, FreeOfUnknownSequenceRaises, "a second time raised KeyError"),
    (check_hash_block_tokens, unchained_hash, "chain"),
    (check_hash_block_tokens, hash_without_lora, "LoRA"),
    (check_hash_block_tokens, hash_of_the_token_sum, "another order"),
    (check_lru_allocator, ForgetsCachedBlocksOnFree, "free block a .*\n*cached blocks"),
    (check_lru_allocator, EvictsMostRecentlyUsed, "(?s)allocate \\(time 7\\).*cached blocks"),
    (check_lru_allocator, EvictsShallowestFirst, "the deeper one"),
    (check_lru_allocator, IncrefWithoutRevive, "incref block b"),
    (check_lru_allocator, EvictKeepsTheHash, "evict"),
    (check_lru_allocator, FreeEvictableCountsOnlyTheFreeList, "get_num_free_blocks"),
    (check_prefix_cache, FindsTheLastTokensBlock, "never reused"),
    (check_prefix_cache, RegistersUncomputedBlocks, "num_computed_tokens=5"),
    (check_prefix_cache, UnchainedPrefixCache, r"register\(F = .*\n*the blocks in the cache"),
    (check_prefix_cache, NeverFinds, "both full blocks"),
    (check_prefix_caching_manager, with_parts(cache_cls=NeverFinds), "get_num_cached_tokens"),
    (check_prefix_caching_manager, with_parts(cache_cls=UnchainedPrefixCache), "(?s)random sequence .*cached blocks"),
    (check_prefix_caching_manager, with_parts(EvictsMostRecentlyUsed), "(?s)random sequence .*cached blocks"),
    (check_prefix_caching_manager, with_parts(ForgetsCachedBlocksOnFree), "leave their blocks cached"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=lambda x: getattr(x, "__name__", None))
def test_each_check_fails_on_a_wrong_implementation(check, wrong, message):
    with pytest.raises(LabCheckFailed, match=message):
        check(wrong)


@pytest.mark.slow
@pytest.mark.parametrize("check, wrong, message", [
    (check_block_manager_in_engine, CopyOnWriteSkipped, "copy-on-write"),
    (check_prefix_caching_in_engine, with_parts(cache_cls=NeverFinds), "hit rate is 0"),
], ids=["copy-on-write skipped", "prefix cache never finds"])
def test_the_engine_checks_fail_on_a_wrong_implementation(check, wrong, message):
    with pytest.raises(LabCheckFailed, match=message):
        check(wrong)
