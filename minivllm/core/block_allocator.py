"""The blocks of one device's KV-cache pool (`vllm/block.py`, and the allocators of
`vllm/core/block_manager_v1.py`, v0). Every block of a pool is in exactly one place:

    free list     never used, or released with no reusable content
    referenced    ref_count > 0: in some sequence's block table
    evictor       ref_count == 0 but kept by the prefix cache; handed out again, least
                  recently used first, when the free list is empty

so `len(free list) + referenced + len(evictor) == num_blocks` at all times.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from minivllm.core.block_queries import BlockQueriesMixin


class Device(enum.Enum):
    GPU = enum.auto()
    CPU = enum.auto()


@dataclass(eq=False)  # identity semantics: two blocks are never "equal"
class PhysicalTokenBlock:
    """One block of a pool: bookkeeping only (the K/V lives in the worker's cache tensors)."""

    device: Device
    block_number: int  # index in the pool: the number that goes into block tables
    block_size: int
    ref_count: int = 0  # how many block tables hold it
    block_hash: int | None = None  # a full, computed block's chained hash (prefix_caching.py)
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to check a cache hit
    num_hashed_tokens: int = 0  # tokens up to this block's end: later in a chain, evicted first
    last_accessed: int = 0  # logical time of the last use, for LRU eviction

    def forget_content(self) -> None:
        self.block_hash, self.token_ids, self.num_hashed_tokens = None, (), 0

    def __repr__(self) -> str:
        return (f"PhysicalTokenBlock({self.device.name}, block_number={self.block_number}, "
                f"ref_count={self.ref_count}, cached={self.block_hash is not None})")


class OutOfBlocksError(RuntimeError):
    """More blocks needed than a pool has free (a caller skipped `can_*`); nothing changed."""


class BlockAllocator(BlockQueriesMixin):
    """The pool of one device: a FIFO free list (a freed block waits before it is reused, so
    pictures show scattered tables) plus, with caching, the prefix cache."""

    def __init__(self, device: Device, block_size: int, num_blocks: int, enable_caching: bool) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_blocks: dict[int, PhysicalTokenBlock] = {}  # block_hash -> its one block
        self.evictor: dict[int, PhysicalTokenBlock] = {}  # block_number -> cached, ref_count 0

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take: the free list plus evictable cached blocks."""
        return len(self.free_block_ids) + len(self.evictor)

    def allocate(self, now: int) -> PhysicalTokenBlock:
        """A fresh block (ref_count 1, no content); evicts a cached block if needed."""
        if self.free_block_ids:
            block = self.blocks[self.free_block_ids.popleft()]
        elif self.evictor:
            block = self._evict()
        else:
            raise OutOfBlocksError(f"no free {self.device.name} blocks left (pool of {self.num_blocks}).")
        block.ref_count, block.last_accessed = 1, now
        return block

    def _evict(self) -> PhysicalTokenBlock:
        victim = min(self.evictor.values(), key=self._eviction_order)
        del self.evictor[victim.block_number]
        del self.cached_blocks[victim.block_hash]
        victim.forget_content()
        return victim

    def incref(self, block: PhysicalTokenBlock, count: int, now: int) -> None:
        """Add `count` holders; revives the block if it was waiting in the evictor."""
        if block.ref_count == 0:
            del self.evictor[block.block_number]
        block.ref_count += count
        block.last_accessed = now

    def free(self, block: PhysicalTokenBlock, now: int) -> None:
        """Drop one holder; at zero the block goes to the evictor (cached) or the free list."""
        if block.ref_count <= 0:
            raise ValueError(f"double free of {block}.")
        block.ref_count -= 1
        block.last_accessed = now
        if block.ref_count > 0:
            return
        if self.is_cached(block):
            self.evictor[block.block_number] = block
        else:
            block.forget_content()
            self.free_block_ids.append(block.block_number)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block for this content, or None (token ids compared: a hash collision
        never hands out other tokens)."""
        block = self.cached_blocks.get(block_hash)
        return block if block is not None and block.token_ids == token_ids else None

    def register(self, block: PhysicalTokenBlock, block_hash: int, token_ids: tuple[int, ...],
                 num_hashed_tokens: int) -> None:
        """Record a full, computed block's content; registered unless a block caches it already."""
        block.block_hash, block.token_ids = block_hash, token_ids
        block.num_hashed_tokens = num_hashed_tokens
        if self.enable_caching and block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block

    def uncache(self, block: PhysicalTokenBlock) -> None:
        """Take the block out of the prefix cache: its recorded content is not to be trusted."""
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.forget_content()

    def is_cached(self, block: PhysicalTokenBlock) -> bool:
        return block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block

    @staticmethod
    def _eviction_order(block: PhysicalTokenBlock) -> tuple[int, int]:
        # Least recently used first; among equals the block deepest in its chain, because a later
        # block is useless without the blocks before it (vLLM's LRUEvictor rule).
        return block.last_accessed, -block.num_hashed_tokens
