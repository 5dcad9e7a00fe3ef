"""Physical KV-cache blocks and the pool that hands them out (one pool per device).

Mirrors `vllm/block.py` (`PhysicalTokenBlock`) and the allocators of
`vllm/core/block_manager_v1.py` (v0). A block is `block_size` token slots of K/V in the
paged cache; here it is only bookkeeping: its number, who references it, and (with prefix
caching) the content hash of the tokens it holds.

A pool's blocks are always in exactly one of three places:

    free list     never used, or released with no reusable content
    referenced    ref_count > 0: in some sequence's block table
    evictor       ref_count == 0 but kept by the prefix cache (a later request may reuse
                  it); handed out again, least recently used first, when the free list is empty

so `len(free list) + referenced + len(evictor) == num_blocks` at all times.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass


class Device(enum.Enum):
    GPU = enum.auto()
    CPU = enum.auto()


@dataclass(eq=False)  # identity semantics: two blocks are never "equal"
class PhysicalTokenBlock:
    """One block of a pool.

    Attributes:
        device: the pool it belongs to.
        block_number: its index in the pool (the number that goes into block tables).
        block_size: token slots per block.
        ref_count: how many block tables hold it.
        block_hash: with prefix caching, the chained hash of a FULL block whose K/V is
            computed (None otherwise); see `BlockSpaceManager` for the chain.
        token_ids: the tokens behind `block_hash` (kept to show, and to check a cache hit).
        num_hashed_tokens: tokens from the start of the sequence to the end of this block:
            its position in the hash chain (later blocks are evicted first).
        last_accessed: logical time of the last use, for LRU eviction.
    """

    device: Device
    block_number: int
    block_size: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    num_hashed_tokens: int = 0
    last_accessed: int = 0

    def forget_content(self) -> None:
        self.block_hash, self.token_ids, self.num_hashed_tokens = None, (), 0

    def __repr__(self) -> str:
        return (
            f"PhysicalTokenBlock({self.device.name}, block_number={self.block_number}, "
            f"ref_count={self.ref_count}, cached={self.block_hash is not None})"
        )


@dataclass(frozen=True)
class BlockInfo:
    """A read-only view of one block, for tools that observe the pool (pictures, tests).

    `cached`: registered in the prefix cache (a later request with the same prefix reuses it).
    """

    block_number: int
    ref_count: int
    block_hash: int | None
    token_ids: tuple[int, ...]
    cached: bool


class OutOfBlocksError(RuntimeError):
    """Raised when an operation needs more blocks than a pool has free.

    The scheduler asks `can_allocate` / `can_append_slots` / `can_swap_*` first, so this
    only fires on a caller bug; nothing is modified when it is raised.
    """


class BlockAllocator:
    """The pool of one device: a FIFO free list plus, with caching, the prefix cache.

    FIFO (take from the front, return to the back) makes a freed block wait before it is
    reused, so pictures show the scattered, non-contiguous tables that paging allows.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int, enable_caching: bool) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # block_hash -> the one block registered for that content (referenced or not).
        self.cached_blocks: dict[int, PhysicalTokenBlock] = {}
        # block_number -> cached block with ref_count 0 (reusable until evicted).
        self.evictor: dict[int, PhysicalTokenBlock] = {}

    # ------------------------------------------------------------------ counts
    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take: the free list plus evictable cached blocks."""
        return len(self.free_block_ids) + len(self.evictor)

    # ------------------------------------------------------------- allocation
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
        # Least recently used first; among equals, the block deepest in its chain, because a
        # later block is useless without the blocks before it (vLLM's LRUEvictor rule).
        victim = min(self.evictor.values(), key=lambda b: (b.last_accessed, -b.num_hashed_tokens))
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
        if self.enable_caching and self.cached_blocks.get(block.block_hash) is block:
            self.evictor[block.block_number] = block
        else:
            block.forget_content()
            self.free_block_ids.append(block.block_number)

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block for this content, or None. Token ids are compared too, so a hash
        collision can never hand out a block with other tokens."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def register(self, block: PhysicalTokenBlock, block_hash: int, token_ids: tuple[int, ...],
                 num_hashed_tokens: int) -> None:
        """Record the content of a full, computed block. It stays unregistered (not reusable)
        when another block already caches that content."""
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

    # ----------------------------------------------------------------- queries
    # For observers (snapshots, tests): each costs what it returns, never the pool size.
    def get_block_info(self, block_number: int) -> BlockInfo:
        block = self.blocks[block_number]
        return BlockInfo(block.block_number, block.ref_count, block.block_hash, block.token_ids,
                         self.is_cached(block))

    def get_free_block_ids(self, limit: int | None = None) -> list[int]:
        """The free list in hand-out order (next first); at most `limit` of them."""
        return list(itertools.islice(self.free_block_ids, limit))

    def get_evictable_block_ids(self) -> list[int]:
        """Cached blocks no table holds, in eviction order (next victim first)."""
        order = sorted(self.evictor.values(), key=lambda b: (b.last_accessed, -b.num_hashed_tokens))
        return [b.block_number for b in order]
