"""Automatic prefix caching, the block manager's side: chained block hashes, the lookup of a
sequence's cached prefix, the registration of computed blocks, swapping that keeps a block's
hash, and the hit rate.

Mirrors the hashing of `vllm/core/block/prefix_caching_block.py` (0.6.3). The pool's side (one
block per hash, the LRU evictor) is `BlockAllocator`'s. `BlockSpaceManager` holds a
`PrefixCache`, or `NoPrefixCache` when caching is off.
"""

from __future__ import annotations

from minivllm.core.block_allocator import BlockAllocator, Device, PhysicalTokenBlock
from minivllm.sequence import Sequence


def hash_block_tokens(parent_block_hash: int | None, token_ids: tuple[int, ...],
                      extra_hash: int = 0) -> int:
    """Chained content hash of one full block: it names the block and every token before it.

    `extra_hash`: the LoRA adapter's id (vLLM's `extra_hash`), so two adapters never share a
    block; 0 (the base model) leaves it out. Python's hash of a tuple of ints is not salted,
    and `BlockAllocator.lookup` compares token ids, so a collision never hands out a block.

    Example: hash_block_tokens(None, (1, 2)) == hash((None, (1, 2)))
    """
    if extra_hash:
        return hash((parent_block_hash, token_ids, extra_hash))
    return hash((parent_block_hash, token_ids))


class PrefixCache:
    """The GPU pool's cached blocks as the block manager looks them up and registers them."""

    def __init__(self, gpu_allocator: BlockAllocator, block_size: int) -> None:
        self.gpu_allocator = gpu_allocator
        self.block_size = block_size
        self.num_lookups = 0
        self.num_hits = 0

    def find(self, seq: Sequence) -> list[PhysicalTokenBlock]:
        """The cached blocks of `seq`'s leading run, never the block holding its last token."""
        token_ids, size = seq.get_token_ids(), self.block_size
        blocks: list[PhysicalTokenBlock] = []
        block_hash = None
        for i in range(self._num_candidates(seq)):
            block_tokens = tuple(token_ids[i * size:(i + 1) * size])
            block_hash = hash_block_tokens(block_hash, block_tokens, seq.lora_int_id)
            block = self.gpu_allocator.lookup(block_hash, block_tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reuse(self, seq: Sequence, num_holders: int, now: int) -> list[PhysicalTokenBlock]:
        """`find`, each block taken by `num_holders` more sequences, counted for the hit rate."""
        blocks = self.find(seq)
        for block in blocks:
            self.gpu_allocator.incref(block, num_holders, now)
        self.num_lookups += self._num_candidates(seq)
        self.num_hits += len(blocks)
        return blocks

    def register(self, seq: Sequence, block_table: list[PhysicalTokenBlock],
                 num_computed_tokens: int) -> None:
        """Hash and register every full block within the first `num_computed_tokens`."""
        size = self.block_size
        num_full = num_computed_tokens // size
        first = num_full
        while first > 0 and block_table[first - 1].block_hash is None:
            first -= 1  # walk back to the last block that already has its hash
        token_ids = seq.get_token_ids()
        for i in range(first, num_full):
            block = block_table[i]
            if block.device is not Device.GPU:
                return
            parent_hash = block_table[i - 1].block_hash if i > 0 else None
            block_tokens = tuple(token_ids[i * size:(i + 1) * size])
            self.gpu_allocator.register(block, hash_block_tokens(parent_hash, block_tokens, seq.lora_int_id),
                                        block_tokens, (i + 1) * size)

    def move(self, src_block: PhysicalTokenBlock, dst: BlockAllocator,
             now: int) -> tuple[PhysicalTokenBlock, bool]:
        """A swapped block's destination in `dst`, keeping its content hash, and whether the worker
        must copy into it: not when the GPU prefix cache still holds that content."""
        if src_block.block_hash is None:
            return dst.allocate(now), True
        cached = dst.lookup(src_block.block_hash, src_block.token_ids)  # None on the CPU pool
        if cached is not None:
            dst.incref(cached, 1, now)
            return cached, False
        dst_block = dst.allocate(now)
        dst.register(dst_block, src_block.block_hash, src_block.token_ids, src_block.num_hashed_tokens)
        return dst_block, True

    def hit_rate(self) -> float:
        """Reused / looked-up blocks over all `reuse` calls; 0.0 before the first."""
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def _num_candidates(self, seq: Sequence) -> int:
        """Full blocks that may be reused: all before the block holding the last token."""
        return (seq.get_len() - 1) // self.block_size


class NoPrefixCache(PrefixCache):
    """Caching off: nothing found, nothing registered; the hit rate is -1.0 (vLLM v0)."""

    def find(self, seq: Sequence) -> list[PhysicalTokenBlock]:
        return []

    def reuse(self, seq: Sequence, num_holders: int, now: int) -> list[PhysicalTokenBlock]:
        return []

    def register(self, seq: Sequence, block_table: list[PhysicalTokenBlock],
                 num_computed_tokens: int) -> None:
        pass

    def move(self, src_block: PhysicalTokenBlock, dst: BlockAllocator,
             now: int) -> tuple[PhysicalTokenBlock, bool]:
        return dst.allocate(now), True

    def hit_rate(self) -> float:
        return -1.0
