"""Unit tests of `BlockSpaceManager`, one behaviour each, against vLLM v0's documented rules
(`vllm/core/block_manager_v1.py` and its tests): the watermark, NEVER for prompts that can
never fit, copy-on-write returning (src, dst), swap mappings, prefix caching."""

from __future__ import annotations

import itertools

import pytest

from minivllm.core.block_manager import (
    AllocStatus,
    BlockSpaceManager,
    OutOfBlocksError,
    hash_block_tokens,
)
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4
_ids = itertools.count()


def make_group(prompt: list[int] | int, n_seqs: int = 1, block_size: int = BLOCK_SIZE) -> SequenceGroup:
    """A waiting request; an int prompt means that many distinct tokens."""
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    seqs = [Sequence(next(_ids), None, tokens, block_size) for _ in range(n_seqs)]
    return SequenceGroup(f"req-{next(_ids)}", seqs, arrival_time=0.0)


def run_prefill(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    """allocate + pretend the model computed the whole prompt (as the engine would); the
    scheduler registers the computed full blocks in the prefix cache (a no-op without it)."""
    bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)
    for seq in group.get_seqs():
        seq.data.num_computed_tokens = seq.get_len()
    bm.mark_blocks_as_computed(group)


def decode(bm: BlockSpaceManager, seq: Sequence, token: int = 7) -> list[tuple[int, int]]:
    seq.append_token_id(token, {token: 0.0})
    cows = bm.append_slots(seq)
    # Register what earlier steps computed (the scheduler's mark_blocks_as_computed), then
    # this step computes the appended token.
    bm.mark_blocks_as_computed(SequenceGroup(f"decode-{seq.seq_id}", [seq], 0.0))
    seq.data.num_computed_tokens = seq.get_len()
    return cows


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(num_gpu_blocks=0),
                                    dict(num_cpu_blocks=-1), dict(watermark=1.0), dict(watermark=-0.1)])
def test_invalid_arguments_raise_value_error(kwargs):
    args = dict(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8) | kwargs
    with pytest.raises(ValueError):
        BlockSpaceManager(**args)


def test_watermark_blocks_is_a_fraction_of_the_gpu_pool():
    assert BlockSpaceManager(16, 1000, 0, watermark=0.01).watermark_blocks == 10
    assert BlockSpaceManager(16, 99, 0, watermark=0.01).watermark_blocks == 0  # int() floors


# ------------------------------------------------------------------- admission
def test_allocate_fills_the_pool_then_says_later():
    # vLLM's test_allocate: 4 blocks, one-block prompts, watermark 0 -> 4 fit, the 5th waits.
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=4, num_cpu_blocks=4, watermark=0.0)
    for _ in range(4):
        group = make_group(BLOCK_SIZE)
        assert bm.can_allocate(group) == AllocStatus.OK
        bm.allocate(group)
    assert bm.get_num_free_gpu_blocks() == 0
    assert bm.can_allocate(make_group(BLOCK_SIZE)) == AllocStatus.LATER


def test_watermark_keeps_blocks_free_at_admission():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.watermark_blocks == 2
    bm.allocate(make_group(6 * BLOCK_SIZE))  # 4 free left
    assert bm.can_allocate(make_group(2 * BLOCK_SIZE)) == AllocStatus.OK  # 4 - 2 >= 2
    assert bm.can_allocate(make_group(3 * BLOCK_SIZE)) == AllocStatus.LATER  # 4 - 3 < 2


def test_prompt_longer_than_pool_minus_watermark_is_never():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.can_allocate(make_group(8 * BLOCK_SIZE)) == AllocStatus.OK
    assert bm.can_allocate(make_group(8 * BLOCK_SIZE + 1)) == AllocStatus.NEVER  # 9 > 10 - 2
    assert bm.can_allocate(make_group(11 * BLOCK_SIZE)) == AllocStatus.NEVER


def test_allocate_counts_the_prompt_once_for_a_group():
    # vLLM v0 allocates the prompt once; the group's sequences share it (ref_count = n).
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(2 * BLOCK_SIZE + 1, n_seqs=3)
    bm.allocate(group)
    tables = [bm.get_block_table(seq) for seq in group.get_seqs()]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [bm.gpu_allocator.blocks[b].ref_count for b in tables[0]] == [3, 3, 3]
    assert bm.get_num_free_gpu_blocks() == 5


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockSpaceManager(BLOCK_SIZE, 2, 0, watermark=0.0)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(make_group(3 * BLOCK_SIZE))
    assert bm.get_num_free_gpu_blocks() == 2 and not bm.block_tables


def test_allocate_twice_or_without_waiting_seq_raises():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0)
    group = make_group(3)
    bm.allocate(group)
    with pytest.raises(ValueError):
        bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)
    with pytest.raises(ValueError):
        bm.can_allocate(group)


# --------------------------------------------------------------------- growth
def test_append_slots_allocates_a_block_only_when_the_last_is_full():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(BLOCK_SIZE - 1)
    run_prefill(bm, group)
    seq = group.first_seq
    assert decode(bm, seq) == [] and len(bm.get_block_table(seq)) == 1  # fills slot 3
    assert decode(bm, seq) == [] and len(bm.get_block_table(seq)) == 2  # token 4: new block
    assert bm.get_num_free_gpu_blocks() == 6


def test_slot_of_each_token_follows_the_block_table():
    # The contract shared with the kernels: slot = table[t // bs] * bs + t % bs, all distinct.
    bm = BlockSpaceManager(BLOCK_SIZE, 16, 0, watermark=0.0)
    groups = [make_group(5), make_group(9)]
    for group in groups:
        run_prefill(bm, group)
    for _ in range(6):
        for group in groups:
            decode(bm, group.first_seq)
    slots = []
    for group in groups:
        seq, table = group.first_seq, bm.get_block_table(group.first_seq)
        slots += [table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(seq.get_len())]
    assert len(set(slots)) == len(slots)


def test_can_append_slots_needs_one_free_block_per_running_seq():
    bm = BlockSpaceManager(BLOCK_SIZE, 3, 0, watermark=0.0)
    group = make_group(BLOCK_SIZE)
    run_prefill(bm, group)
    for i in range(2):
        child = group.first_seq.fork(1000 + i)
        bm.fork(group.first_seq, child)
        group.add(child)
    assert bm.get_num_free_gpu_blocks() == 2 and group.num_seqs(SequenceStatus.RUNNING) == 3
    assert not bm.can_append_slots(group)
    group.seqs[2].status = SequenceStatus.FINISHED_STOPPED
    assert bm.can_append_slots(group)


def test_lookahead_slots_reserve_the_blocks_of_a_multi_step_run():
    # BLOCK_SIZE 4: 5 tokens + 6 lookahead slots = 11 slots = 3 blocks, written by later steps.
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(4)
    run_prefill(bm, group)
    seq = group.first_seq
    seq.append_token_id(7, {7: 0.0})
    assert bm.can_append_slots(group, num_lookahead_slots=6)  # 1 + ceil(6 / 4) = 3 <= 7 free
    assert bm.append_slots(seq, num_lookahead_slots=6) == []
    assert len(bm.get_block_table(seq)) == 3
    for token in range(6):  # the run's later tokens land in reserved slots: no new block
        seq.append_token_id(token, {token: 0.0})
        assert bm.append_slots(seq) == [] and len(bm.get_block_table(seq)) == 3
    assert not bm.can_append_slots(group, num_lookahead_slots=4 * BLOCK_SIZE + 1)  # 6 blocks > 5 free
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 8


def test_copy_on_write_targets_the_newest_tokens_block_not_a_lookahead_block():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(2)
    run_prefill(bm, group)
    parent = group.first_seq
    parent.append_token_id(7, {7: 0.0})
    bm.append_slots(parent, num_lookahead_slots=BLOCK_SIZE)  # 3 tokens + 4 slots: 2 blocks
    child = parent.fork(2000)
    bm.fork(parent, child)
    child.append_token_id(8, {8: 0.0})  # token 3: block 0, shared with the parent
    first_block = bm.get_block_table(parent)[0]
    [(src, dst)] = bm.append_slots(child)
    assert src == first_block and bm.get_block_table(child)[0] == dst != first_block
    assert bm.get_block_table(child)[1] == bm.get_block_table(parent)[1]


def test_append_slots_on_swapped_or_unknown_seq_raises():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0)
    with pytest.raises(ValueError):
        bm.append_slots(make_group(3).first_seq)


# ------------------------------------------------------------ fork and CoW
def test_fork_shares_every_block():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(2 * BLOCK_SIZE + 2)
    run_prefill(bm, group)
    parent = group.first_seq
    child = parent.fork(9999)
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert all(bm.gpu_allocator.blocks[b].ref_count == 2 for b in bm.get_block_table(parent))
    assert bm.get_num_free_gpu_blocks() == 5  # forking costs no memory


def test_copy_on_write_returns_src_dst_and_moves_only_the_writer():
    # The launch-blog picture: two samples share a partly filled last block; the first to
    # write gets a copy (src -> dst) and both ref counts drop to 1.
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(BLOCK_SIZE + 2)
    run_prefill(bm, group)
    parent = group.first_seq
    child = parent.fork(9998)
    bm.fork(parent, child)
    shared_last = bm.get_block_table(parent)[-1]
    cows = decode(bm, parent, token=1)
    new_last = bm.get_block_table(parent)[-1]
    assert cows == [(shared_last, new_last)] and new_last != shared_last
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]  # full block still shared
    assert bm.get_block_table(child)[-1] == shared_last
    assert bm.gpu_allocator.blocks[shared_last].ref_count == 1
    assert bm.gpu_allocator.blocks[new_last].ref_count == 1
    assert bm.gpu_allocator.blocks[bm.get_block_table(parent)[0]].ref_count == 2
    assert decode(bm, child, token=2) == []  # the child now owns the old block: no copy


def test_no_copy_on_write_when_the_shared_last_block_is_full():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(BLOCK_SIZE)
    run_prefill(bm, group)
    child = group.first_seq.fork(9997)
    bm.fork(group.first_seq, child)
    assert decode(bm, group.first_seq) == []  # the new token starts a new block
    assert bm.get_block_table(child) == bm.get_block_table(group.first_seq)[:1]


# ---------------------------------------------------------------------- free
def test_free_returns_every_block_and_is_idempotent():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(3 * BLOCK_SIZE)
    run_prefill(bm, group)
    bm.free(group.first_seq)
    assert bm.get_num_free_gpu_blocks() == 8
    bm.free(group.first_seq)
    bm.free(make_group(1).first_seq)  # never allocated
    assert bm.get_num_free_gpu_blocks() == 8
    with pytest.raises(ValueError):
        bm.get_block_table(group.first_seq)


def test_freeing_one_of_two_sharers_keeps_the_block():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(BLOCK_SIZE, n_seqs=2)
    run_prefill(bm, group)
    a, b = group.get_seqs()
    bm.free(a)
    assert bm.get_num_free_gpu_blocks() == 7 and bm.gpu_allocator.blocks[bm.get_block_table(b)[0]].ref_count == 1
    bm.free(b)
    assert bm.get_num_free_gpu_blocks() == 8


# ------------------------------------------------------------------ swapping
def test_swap_out_then_in_maps_shared_blocks_once():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 8, watermark=0.0)
    group = make_group(BLOCK_SIZE + 1)
    run_prefill(bm, group)
    parent = group.first_seq
    child = parent.fork(9996)
    bm.fork(parent, child)
    group.add(child)
    decode(bm, parent)  # CoW: parent and child now share block 0 only -> 3 unique blocks
    gpu_tables = {s.seq_id: bm.get_block_table(s) for s in group.get_seqs()}
    assert bm.can_swap_out(group)
    mapping = bm.swap_out(group)
    group.set_status(SequenceStatus.SWAPPED)
    assert len(mapping) == 3 and bm.get_num_free_cpu_blocks() == 5 and bm.get_num_free_gpu_blocks() == 8
    gpu_to_cpu = dict(mapping)
    for seq in group.get_seqs():  # each block table is translated through the mapping
        assert bm.get_block_table(seq) == [gpu_to_cpu[b] for b in gpu_tables[seq.seq_id]]
    assert bm.cpu_allocator.blocks[gpu_to_cpu[gpu_tables[parent.seq_id][0]]].ref_count == 2
    assert bm.can_swap_in(group) == AllocStatus.OK
    back = bm.swap_in(group)
    group.set_status(SequenceStatus.RUNNING)
    assert sorted(cpu for cpu, _ in back) == sorted(gpu_to_cpu.values())
    cpu_to_gpu = dict(back)
    for seq in group.get_seqs():
        assert bm.get_block_table(seq) == [cpu_to_gpu[gpu_to_cpu[b]] for b in gpu_tables[seq.seq_id]]
    assert bm.get_num_free_cpu_blocks() == 8 and bm.get_num_free_gpu_blocks() == 5


def test_swap_out_without_cpu_room_raises_and_changes_nothing():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 1, watermark=0.0)
    group = make_group(2 * BLOCK_SIZE)
    run_prefill(bm, group)
    assert not bm.can_swap_out(group)
    with pytest.raises(OutOfBlocksError):
        bm.swap_out(group)
    assert bm.get_num_free_gpu_blocks() == 6 and bm.get_num_free_cpu_blocks() == 1


def test_can_swap_in_reserves_a_block_per_sequence_and_the_watermark():
    # vLLM v0: required = unique blocks + one per swapped sequence (for its next token).
    bm = BlockSpaceManager(BLOCK_SIZE, 4, 8, watermark=0.0)
    group = make_group(3 * BLOCK_SIZE)
    run_prefill(bm, group)
    bm.swap_out(group)
    group.set_status(SequenceStatus.SWAPPED)
    assert bm.can_swap_in(group) == AllocStatus.OK  # 3 + 1 <= 4
    other = make_group(BLOCK_SIZE)
    run_prefill(bm, other)
    assert bm.can_swap_in(group) == AllocStatus.LATER
    child = group.first_seq.fork(9995)
    bm.fork(group.first_seq, child)
    group.add(child)
    child.status = SequenceStatus.SWAPPED
    bm.free(other.first_seq)
    assert bm.can_swap_in(group) == AllocStatus.NEVER  # 3 + 2 > 4 blocks in the whole pool


# ------------------------------------------------------------ prefix caching
def cached_manager(num_gpu_blocks: int = 8) -> BlockSpaceManager:
    return BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks, 0, watermark=0.0, enable_caching=True)


def test_hash_chain_depends_on_the_whole_prefix():
    a = hash_block_tokens(hash_block_tokens(None, (1, 2, 3, 4)), (5, 6, 7, 8))
    b = hash_block_tokens(hash_block_tokens(None, (0, 2, 3, 4)), (5, 6, 7, 8))
    assert a != b  # same tokens in block 1, different block 0
    assert a == hash_block_tokens(hash_block_tokens(None, (1, 2, 3, 4)), (5, 6, 7, 8))


def test_without_caching_nothing_is_cached():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    first = make_group(list(range(9)))
    run_prefill(bm, first)
    bm.free(first.first_seq)
    assert bm.get_num_cached_tokens(make_group(list(range(9))).first_seq) == 0
    assert bm.get_prefix_cache_hit_rate() == -1.0


def test_identical_prompt_reuses_full_blocks_but_not_the_last_token_block():
    bm = cached_manager()
    prompt = list(range(10))  # blocks [0-3] [4-7] [8 9]
    first = make_group(prompt)
    assert bm.get_num_cached_tokens(first.first_seq) == 0
    run_prefill(bm, first)
    bm.mark_blocks_as_computed(first)
    second = make_group(prompt)
    assert bm.get_num_cached_tokens(second.first_seq) == 8
    bm.allocate(second)
    t1, t2 = bm.get_block_table(first.first_seq), bm.get_block_table(second.first_seq)
    assert t2[:2] == t1[:2] and t2[2] != t1[2]
    assert [bm.gpu_allocator.blocks[b].ref_count for b in t2] == [2, 2, 1]
    assert bm.get_num_cached_tokens(second.first_seq) == 8  # allocate reused t1[:2]
    assert bm.get_prefix_cache_hit_rate() == pytest.approx(2 / 4)  # 0/2 then 2/2


def test_block_aligned_prompt_never_reuses_its_last_block():
    # 8 tokens = 2 full blocks; the second holds the last token, so logits need it computed.
    bm = cached_manager()
    first = make_group(list(range(8)))
    run_prefill(bm, first)
    bm.free(first.first_seq)
    assert bm.get_num_cached_tokens(make_group(list(range(8))).first_seq) == 4
    assert bm.get_num_cached_tokens(make_group([5]).first_seq) == 0


def test_different_prefix_misses_even_with_equal_block_tokens():
    bm = cached_manager()
    run_prefill(bm, first := make_group([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    bm.free(first.first_seq)
    assert bm.get_num_cached_tokens(make_group([0, 2, 3, 4, 5, 6, 7, 8, 9]).first_seq) == 0
    assert bm.get_num_cached_tokens(make_group([1, 2, 3, 4, 5, 6, 7, 0, 9]).first_seq) == 4


def test_only_computed_blocks_are_cached():
    bm = cached_manager()
    first = make_group(list(range(9)))
    bm.allocate(first)  # allocated but nothing computed yet
    first.set_status(SequenceStatus.RUNNING)
    assert bm.get_num_cached_tokens(make_group(list(range(9))).first_seq) == 0
    bm.mark_blocks_as_computed(first, token_chunk_size=5)  # chunk covers block 0 only
    assert bm.get_num_cached_tokens(make_group(list(range(9))).first_seq) == 4
    bm.mark_blocks_as_computed(first, token_chunk_size=9)
    assert bm.get_num_cached_tokens(make_group(list(range(9))).first_seq) == 8


def test_freed_cached_blocks_stay_until_evicted_and_count_as_free():
    bm = cached_manager(num_gpu_blocks=4)
    first = make_group(list(range(9)))
    run_prefill(bm, first)
    bm.free(first.first_seq)
    cached, free = bm.gpu_allocator.get_evictable_block_ids(), bm.gpu_allocator.get_free_block_ids()
    assert len(cached) == 2 and len(free) == 2
    assert bm.get_num_free_gpu_blocks() == 4  # evictable blocks can be handed out
    assert bm.get_num_cached_tokens(make_group(list(range(9))).first_seq) == 8


def test_eviction_is_lru_then_deepest_block_first():
    bm = cached_manager(num_gpu_blocks=6)
    old, new = make_group([1] * 9), make_group([2] * 9)
    run_prefill(bm, old)
    run_prefill(bm, new)
    old_table, new_table = bm.get_block_table(old.first_seq), bm.get_block_table(new.first_seq)
    bm.free(old.first_seq)  # freed first: least recently used
    bm.free(new.first_seq)
    assert bm.gpu_allocator.get_evictable_block_ids() == [old_table[1], old_table[0], new_table[1], new_table[0]]
    run_prefill(bm, make_group([3] * 13))  # 4 blocks: 2 from the free list, then 2 evictions
    assert bm.get_num_cached_tokens(make_group([1] * 9).first_seq) == 0
    assert bm.get_num_cached_tokens(make_group([2] * 9).first_seq) == 8
    run_prefill(bm, make_group([4] * 4))  # one more: evicts the deeper block of `new` first
    assert bm.get_num_cached_tokens(make_group([2] * 9).first_seq) == 4


def test_cache_hit_refreshes_lru_order():
    bm = cached_manager(num_gpu_blocks=4)
    a, b = make_group([1] * 5), make_group([2] * 5)
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a.first_seq)
    bm.free(b.first_seq)
    reuse = make_group([1] * 5)
    run_prefill(bm, reuse)  # hit on a's block
    bm.free(reuse.first_seq)  # a's block is now the most recently used
    run_prefill(bm, make_group([3] * 12))  # needs 3 of 4 blocks: evicts b's block first
    assert bm.get_num_cached_tokens(make_group([1] * 5).first_seq) == 4
    assert bm.get_num_cached_tokens(make_group([2] * 5).first_seq) == 0


def test_decode_filled_block_is_registered_for_later_requests():
    bm = cached_manager()
    group = make_group([1, 2, 3])
    run_prefill(bm, group)
    seq = group.first_seq
    for token in (4, 5, 6):
        decode(bm, seq, token)
    assert seq.get_token_ids() == [1, 2, 3, 4, 5, 6]
    # Block 0 filled by decode; registered once the next append (or free) sees it computed.
    assert bm.get_num_cached_tokens(make_group([1, 2, 3, 4, 9]).first_seq) == 4


def test_same_content_twice_leaves_the_second_block_unregistered():
    bm = cached_manager()
    a, b = make_group(list(range(5))), make_group(list(range(5)))
    bm.allocate(a)
    bm.allocate(b)  # no hit: a is not computed yet
    for g in (a, b):
        g.set_status(SequenceStatus.RUNNING)
        g.first_seq.data.num_computed_tokens = 5
        bm.mark_blocks_as_computed(g)
    first_a, first_b = bm.get_block_table(a.first_seq)[0], bm.get_block_table(b.first_seq)[0]
    assert first_a != first_b
    assert bm.gpu_allocator.is_cached(bm.gpu_allocator.blocks[first_a])
    assert not bm.gpu_allocator.is_cached(bm.gpu_allocator.blocks[first_b])
    bm.free(b.first_seq)
    assert first_b in bm.gpu_allocator.get_free_block_ids()  # not kept: it duplicates a cached block


def test_appends_never_write_into_a_cached_block():
    bm = cached_manager(num_gpu_blocks=16)
    prompt = list(range(8))
    first = make_group(prompt)
    run_prefill(bm, first)
    second = make_group(prompt)
    run_prefill(bm, second)
    for seq in (first.first_seq, second.first_seq):
        for step in range(6):
            cows = decode(bm, seq, token=step)
            t = seq.get_len() - 1
            block = bm.block_tables[seq.seq_id][t // BLOCK_SIZE]
            assert cows == [] and block.ref_count == 1
            assert not bm.gpu_allocator.is_cached(block)


def test_swap_in_reuses_blocks_still_cached_on_gpu():
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 8, watermark=0.0, enable_caching=True)
    group = make_group(list(range(9)))
    run_prefill(bm, group)
    bm.mark_blocks_as_computed(group)
    table = bm.get_block_table(group.first_seq)
    out = bm.swap_out(group)
    group.set_status(SequenceStatus.SWAPPED)
    assert len(out) == 3
    back = bm.swap_in(group)  # the two full blocks never left the GPU cache: only block 2 copies
    assert len(back) == 1 and bm.get_block_table(group.first_seq)[:2] == table[:2]


# ------------------------------------------------------------------ block size
def test_the_managers_block_size_counts_the_blocks():
    """A 7-token prompt needs 2 blocks of 4, whatever block size its Sequence was built with
    (16 would be one block): the manager alone owns the block size, as vLLM's v2 manager."""
    bm = BlockSpaceManager(BLOCK_SIZE, 8, 0, watermark=0.0)
    group = make_group(7)
    assert bm.get_num_required_blocks(group.first_seq) == 2
    bm.allocate(group)
    assert len(bm.get_block_table(group.first_seq)) == 2
    other = make_group(7, block_size=16)
    seq = other.first_seq
    assert seq.n_blocks == 1 and bm.get_num_required_blocks(seq) == 2
    assert bm.can_allocate(other) == AllocStatus.OK
    bm.allocate(other)
    other.set_status(SequenceStatus.RUNNING)
    assert len(bm.get_block_table(seq)) == 2 and bm.get_num_free_gpu_blocks() == 8 - 4
    seq.append_token_id(7, {7: 0.0})  # the 8th token fills the second block of 4
    assert bm.append_slots(seq) == [] and len(bm.get_block_table(seq)) == 2
    seq.append_token_id(7, {7: 0.0})  # the 9th starts a third block (not at 17, as 16 would)
    assert bm.append_slots(seq) == [] and len(bm.get_block_table(seq)) == 3
    assert bm.get_num_free_gpu_blocks() == 8 - 5


def test_a_prompt_too_big_for_the_managers_blocks_is_never_admitted_whatever_its_own_size():
    bm = BlockSpaceManager(BLOCK_SIZE, 2, 0, watermark=0.0)
    # 9 tokens: one block of 16 by the Sequence's count, three of the manager's 4.
    assert bm.can_allocate(make_group(9, block_size=16)) == AllocStatus.NEVER
    assert bm.can_allocate(make_group(8, block_size=1)) == AllocStatus.OK


def test_queries_for_observers():
    bm = cached_manager()
    group = make_group([1, 2, 3, 4, 5])
    run_prefill(bm, group)
    seq = group.first_seq
    table = bm.get_block_table(seq)
    assert bm.has_blocks(seq) and not bm.is_swapped_out(seq)
    first = bm.gpu_allocator.get_block_info(table[0])
    assert (first.ref_count, first.token_ids, first.cached) == (1, (1, 2, 3, 4), True)
    assert first.block_hash == hash_block_tokens(None, (1, 2, 3, 4))
    assert not bm.gpu_allocator.get_block_info(table[1]).cached
    assert bm.gpu_allocator.get_free_block_ids(limit=3) == bm.gpu_allocator.get_free_block_ids()[:3]
    bm.free(seq)
    assert not bm.has_blocks(seq) and bm.gpu_allocator.get_evictable_block_ids() == [table[0]]
