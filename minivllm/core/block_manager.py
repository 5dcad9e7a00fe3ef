"""The block manager: each sequence's block table, from logical to physical KV-cache blocks.

Mirrors `vllm/core/block_manager_v1.py` (v0, `BlockSpaceManagerV1`). Token t of a sequence
lives in slot `block_table[t // block_size] * block_size + t % block_size`:

    logical blocks of seq 7      block table        physical GPU blocks
    [The cat sat on] ----------> [ 4,  --------->   #4  ref_count 1
    [the mat ....  ] ---------->   9 ] --------->   #9  ref_count 1

The scheduler asks (`can_allocate`, `can_append_slots`, `can_swap_in`, `can_swap_out`), then
acts; the acting calls return the (src, dst) block pairs the worker copies.
"""

from __future__ import annotations

import enum

from minivllm.core.block_allocator import (BlockAllocator, Device, OutOfBlocksError,
                                           PhysicalTokenBlock)
from minivllm.core.prefix_caching import NoPrefixCache, PrefixCache, hash_block_tokens
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["AllocStatus", "BlockSpaceManager", "OutOfBlocksError", "hash_block_tokens"]

BlockTable = list[PhysicalTokenBlock]


class AllocStatus(enum.Enum):
    """OK: fits now. LATER: once other requests free blocks. NEVER: not even in an empty pool."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class BlockSpaceManager:
    """Block tables of every sequence over a GPU and a CPU pool (vLLM v0's API).

    `watermark`: the fraction of GPU blocks admission keeps free, so running sequences can
    grow without preempting what was just admitted. `enable_caching`: automatic prefix caching
    of full, computed blocks. Misuse (a sequence without blocks, a child that has some) is a
    ValueError; a pool too small raises `OutOfBlocksError` and changes nothing.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need num_gpu_blocks >= 1 and num_cpu_blocks >= 0, "
                             f"got {num_gpu_blocks} and {num_cpu_blocks}.")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}.")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_caching = enable_caching
        self.gpu_allocator = BlockAllocator(Device.GPU, block_size, num_gpu_blocks, enable_caching)
        self.cpu_allocator = BlockAllocator(Device.CPU, block_size, num_cpu_blocks, False)
        # seq_id -> its block table (all GPU or all CPU).
        self.block_tables: dict[int, BlockTable] = {}
        self._num_cached_tokens: dict[int, int] = {}  # seq_id -> what `allocate` reused
        cache_class = PrefixCache if enable_caching else NoPrefixCache
        self.prefix_cache = cache_class(self.gpu_allocator, block_size)
        # A logical clock for LRU: deterministic, unlike wall time.
        self._clock = 0

    # ================================================================ admission
    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        """Can the group's prompt (one copy: its sequences share it) get its blocks and leave the
        watermark free? Forks are not reserved for: `can_append_slots` checks them each step."""
        num_required = self.get_num_required_blocks(self._waiting_seq(seq_group))
        if self.num_total_gpu_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> None:
        """One block table shared by the group's waiting sequences: the prefix cache's leading
        blocks (`get_num_cached_tokens`), then fresh ones."""
        seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
        seq = self._waiting_seq(seq_group)
        if any(s.get_token_ids() != seq.get_token_ids() for s in seqs):
            raise ValueError("the waiting sequences of a group must share their tokens.")
        if any(s.seq_id in self.block_tables for s in seqs):
            raise ValueError(f"request {seq_group.request_id} already has blocks.")
        num_blocks = self.get_num_required_blocks(seq)
        if num_blocks > self.gpu_allocator.get_num_free_blocks():
            raise OutOfBlocksError(f"request {seq_group.request_id} needs {num_blocks} blocks, "
                                   f"{self.gpu_allocator.get_num_free_blocks()} are free.")
        now = self._tick()
        block_table = self.prefix_cache.reuse(seq, len(seqs), now)
        num_cached_tokens = len(block_table) * self.block_size
        while len(block_table) < num_blocks:
            block = self.gpu_allocator.allocate(now)
            block.ref_count = len(seqs)
            block_table.append(block)
        for s in seqs:
            self.block_tables[s.seq_id] = list(block_table)
            self._num_cached_tokens[s.seq_id] = num_cached_tokens

    def get_num_required_blocks(self, seq: Sequence) -> int:
        """Blocks that hold every token of `seq` (the manager's block size, not the sequence's)."""
        return -(-seq.get_len() // self.block_size)

    def _waiting_seq(self, seq_group: SequenceGroup) -> Sequence:
        seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
        if not seqs:
            raise ValueError(f"request {seq_group.request_id} has no waiting sequence.")
        return seqs[0]

    # ================================================================== growth
    def can_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> bool:
        """Conservatively one new block per running sequence (vLLM v0's rule), plus the
        blocks `num_lookahead_slots` more tokens could fill (multi-step)."""
        num_seqs = seq_group.num_seqs(status=SequenceStatus.RUNNING)
        blocks_per_seq = 1 + -(-num_lookahead_slots // self.block_size)
        return num_seqs * blocks_per_seq <= self.gpu_allocator.get_num_free_blocks()

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Give the newest token of `seq` (already appended) a slot it alone may write, plus
        `num_lookahead_slots` more. Returns the copy-on-write pairs [(src, dst)], if any."""
        block_table = self._get_table(seq)
        now = self._tick()
        num_blocks = -(-(seq.get_len() + num_lookahead_slots) // self.block_size)
        while len(block_table) < num_blocks:  # the last block is full: start a new one
            block_table.append(self.gpu_allocator.allocate(now))
        # The block the newest token goes to (the last one, unless lookahead slots follow).
        index = (seq.get_len() - 1) // self.block_size
        block = block_table[index]
        if block.device is not Device.GPU:
            raise ValueError(f"sequence {seq.seq_id} is swapped out; swap it in first.")
        if block.ref_count == 1:
            return []
        # Shared (a fork): never write into a block someone else reads. Copy, then write.
        new_block = self.gpu_allocator.allocate(now)
        block_table[index] = new_block
        self.gpu_allocator.free(block, now)
        return [(block.block_number, new_block.block_number)]

    # ================================================================= sharing
    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child references every block of the parent (ref_count += 1 each)."""
        if child_seq.seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq.seq_id} already has blocks.")
        parent_table = self._get_table(parent_seq)
        now = self._tick()
        for block in parent_table:
            self._allocator(block).incref(block, 1, now)
        self.block_tables[child_seq.seq_id] = list(parent_table)
        self._num_cached_tokens[child_seq.seq_id] = self._num_cached_tokens[parent_seq.seq_id]

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (a no-op for a sequence without blocks)."""
        if seq.seq_id not in self.block_tables:
            return
        now = self._tick()
        for block in self.block_tables.pop(seq.seq_id):
            self._allocator(block).free(block, now)
        del self._num_cached_tokens[seq.seq_id]

    # ================================================================ swapping
    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        return len(self._unique_blocks(seq_group, SequenceStatus.RUNNING)) <= \
            self.cpu_allocator.get_num_free_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's running sequences to CPU (a shared block once): (gpu, cpu) pairs."""
        if not self.can_swap_out(seq_group):
            raise OutOfBlocksError(f"request {seq_group.request_id} does not fit in the CPU pool.")
        return self._swap(seq_group, SequenceStatus.RUNNING, self.gpu_allocator, self.cpu_allocator)

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        """Like `can_allocate`, plus one block per sequence for the token it appends next."""
        num_required = (len(self._unique_blocks(seq_group, SequenceStatus.SWAPPED))
                        + seq_group.num_seqs(status=SequenceStatus.SWAPPED))
        if self.num_total_gpu_blocks < num_required:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's swapped sequences back to GPU: (cpu, gpu) pairs."""
        num_blocks = len(self._unique_blocks(seq_group, SequenceStatus.SWAPPED))
        if num_blocks > self.gpu_allocator.get_num_free_blocks():
            raise OutOfBlocksError(f"request {seq_group.request_id} does not fit in the GPU pool.")
        return self._swap(seq_group, SequenceStatus.SWAPPED, self.cpu_allocator, self.gpu_allocator)

    def _swap(self, seq_group: SequenceGroup, status: SequenceStatus, src: BlockAllocator,
              dst: BlockAllocator) -> list[tuple[int, int]]:
        now = self._tick()
        mapping: dict[int, PhysicalTokenBlock] = {}  # src block number -> its dst block
        copies: list[tuple[int, int]] = []
        for seq in seq_group.get_seqs(status=status):
            new_table = []
            for src_block in self._get_table(seq):
                dst_block = mapping.get(src_block.block_number)
                if dst_block is not None:  # shared within the group: one copy, one more holder
                    dst.incref(dst_block, 1, now)
                else:
                    dst_block, needs_copy = self.prefix_cache.move(src_block, dst, now)
                    mapping[src_block.block_number] = dst_block
                    if needs_copy:
                        copies.append((src_block.block_number, dst_block.block_number))
                new_table.append(dst_block)
                src.free(src_block, now)
            self.block_tables[seq.seq_id] = new_table
        return copies

    # ========================================================== prefix caching
    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of `seq` (prompt, plus outputs after a recompute) whose K/V the prefix
        cache holds: whole blocks, never the one holding the last token, so a prefill always
        computes one. Before `allocate` a lookup, after it what `allocate` reused."""
        if seq.seq_id in self._num_cached_tokens:
            return self._num_cached_tokens[seq.seq_id]
        return len(self.prefix_cache.find(seq)) * self.block_size

    def mark_blocks_as_computed(self, seq_group: SequenceGroup, token_chunk_size: int = 0) -> None:
        """Register in the prefix cache the group's full blocks that `num_computed_tokens +
        token_chunk_size` covers: the only way a block enters it. The scheduler calls it right
        after scheduling the group (the step runs before anyone reads the cache); pass 0 when
        `num_computed_tokens` is up to date."""
        for seq in seq_group.get_seqs():
            if seq.seq_id in self.block_tables:
                num_computed = min(seq.get_num_computed_tokens() + token_chunk_size, seq.get_len())
                self.prefix_cache.register(seq, self.block_tables[seq.seq_id], num_computed)

    def forget_computed_blocks(self, seq_group: SequenceGroup) -> None:
        """Take the group's blocks out of the prefix cache when the step meant to compute them
        failed (their K/V may never have been written); holders keep them."""
        for seq in seq_group.get_seqs():
            for block in self.block_tables.get(seq.seq_id, []):
                if block.device is Device.GPU:
                    self.gpu_allocator.uncache(block)

    def get_prefix_cache_hit_rate(self) -> float:
        """Reused / looked-up blocks over all `allocate` calls; -1.0 without caching (vLLM v0)."""
        return self.prefix_cache.hit_rate()

    # ================================================================= queries
    def get_block_table(self, seq: Sequence) -> list[int]:
        return [block.block_number for block in self._get_table(seq)]

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def is_swapped_out(self, seq: Sequence) -> bool:
        table = self._get_table(seq)
        return bool(table) and table[0].device is Device.CPU

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    # ================================================================= helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _allocator(self, block: PhysicalTokenBlock) -> BlockAllocator:
        return self.gpu_allocator if block.device is Device.GPU else self.cpu_allocator

    def _get_table(self, seq: Sequence) -> BlockTable:
        if seq.seq_id not in self.block_tables:
            raise ValueError(f"sequence {seq.seq_id} has no blocks (not allocated, or freed).")
        return self.block_tables[seq.seq_id]

    def _unique_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> list[PhysicalTokenBlock]:
        blocks: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_seqs(status=status):
            for block in self.block_tables.get(seq.seq_id, []):
                blocks[block.block_number] = block
        return list(blocks.values())
