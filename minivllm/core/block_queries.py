"""Read-only queries of a block pool for observers (snapshots, pictures, tests); the engine asks
none of them. Each costs what it returns, never the pool size. `BlockAllocator` inherits them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockInfo:
    """A read-only view of one block."""

    block_number: int
    ref_count: int
    block_hash: int | None
    token_ids: tuple[int, ...]
    cached: bool  # registered in the prefix cache


class BlockQueriesMixin:
    """Needs the allocator's `blocks`, `free_block_ids`, `evictor`, `is_cached`, `_eviction_order`."""

    def get_block_info(self, block_number: int) -> BlockInfo:
        block = self.blocks[block_number]
        return BlockInfo(block.block_number, block.ref_count, block.block_hash, block.token_ids,
                         self.is_cached(block))

    def get_free_block_ids(self, limit: int | None = None) -> list[int]:
        """The free list in hand-out order (next first); at most `limit` of them."""
        return list(itertools.islice(self.free_block_ids, limit))

    def get_evictable_block_ids(self) -> list[int]:
        """Cached blocks no table holds, in eviction order (next victim first)."""
        return [b.block_number for b in sorted(self.evictor.values(), key=self._eviction_order)]
