"""Snapshots observe the runtime from outside: what they record agrees with the scheduler's own
decision, and copying the block manager costs the blocks in use, not the pool."""

from __future__ import annotations

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.viz.sim import SimRequest, Simulator
from minivllm.viz.snapshot import MAX_LISTED_FREE_BLOCKS, snapshot_block_manager


def test_snapshot_reads_only_the_blocks_in_use_of_a_huge_pool():
    bm = BlockSpaceManager(16, 200_000, 0, watermark=0.0, enable_caching=True)
    group = SequenceGroup("r", [Sequence(0, None, list(range(40)), 16)], 0.0)
    bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)
    group.first_seq.data.num_computed_tokens = 40
    bm.mark_blocks_as_computed(group)
    asked = []
    get_block_info = bm.gpu_allocator.get_block_info
    bm.gpu_allocator.get_block_info = lambda n: asked.append(n) or get_block_info(n)
    snap = snapshot_block_manager(bm, group.get_seqs())
    table = bm.get_block_table(group.first_seq)
    assert sorted(asked) == sorted(table)  # three blocks asked about, not 200,000
    assert set(snap.gpu_blocks_in_use) == set(table)
    assert len(snap.free_gpu_block_ids) == MAX_LISTED_FREE_BLOCKS < snap.num_free_gpu_blocks == 200_000 - 3
    assert snap.gpu_blocks_in_use[table[0]].cached and snap.gpu_blocks_in_use[table[0]].token_ids == tuple(range(16))
    assert snap.gpu_blocks_in_use[table[2]].token_ids == tuple(range(32, 40))


def test_snapshot_is_plain_data_of_the_state():
    bm = BlockSpaceManager(4, 8, 0, watermark=0.0, enable_caching=True)
    group = SequenceGroup("r", [Sequence(0, None, [1, 2, 3, 4, 5], 4)], 0.0)
    bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)
    group.first_seq.data.num_computed_tokens = 5
    bm.mark_blocks_as_computed(group)
    snap = snapshot_block_manager(bm, group.get_seqs())
    table = snap.gpu_block_tables[0]
    assert table == bm.get_block_table(group.first_seq)
    assert snap.gpu_blocks[table[0]].token_ids == (1, 2, 3, 4) and snap.gpu_blocks[table[0]].cached
    assert snap.gpu_blocks[table[1]].token_ids == (5,) and not snap.gpu_blocks[table[1]].cached
    assert len(snap.free_gpu_block_ids) == 6 and snap.seq_token_ids[0] == [1, 2, 3, 4, 5]
    assert len(snap.gpu_blocks) == 8 and sum(b.ref_count for b in snap.gpu_blocks) == 2
    bm.free(group.first_seq)
    assert snap.gpu_block_tables == {0: table}  # a copy, not a view


def test_recorded_moves_agree_with_the_schedulers_count():
    """Preemptions and swap-ins are read from the queues; they must add up to `preempted`."""
    requests = [SimRequest(str(i), list(range(1, 9)), [30, 25] if i % 2 else [40], arrival_step=i)
                for i in range(6)]
    sim = Simulator(SchedulerConfig(max_num_seqs=6, max_model_len=128),
                    CacheConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=32), include_block_manager=True)
    result = sim.run(requests)
    moved = [s for s in result.snapshots if s.preempted]
    assert moved and any(s.preempted_by_swap for s in moved) and any(s.preempted_by_recompute for s in moved)
    for snapshot in result.snapshots:
        assert len(snapshot.preempted_by_recompute) + len(snapshot.preempted_by_swap) == snapshot.preempted
        assert set(snapshot.preempted_by_recompute) <= set(snapshot.waiting)
        assert set(snapshot.preempted_by_swap) <= set(snapshot.swapped)
        assert set(snapshot.swapped_in) <= set(snapshot.running)
        bm = snapshot.block_manager
        assert bm.num_free_gpu_blocks == snapshot.num_free_gpu_blocks
    swapped_out = {rid for s in result.snapshots for rid in s.preempted_by_swap}
    swapped_in = {rid for s in result.snapshots for rid in s.swapped_in}
    assert swapped_out == swapped_in
    assert sum(r.num_preemptions for r in result.results.values()) == sum(s.preempted for s in result.snapshots)


def test_recorder_detaches():
    sim = Simulator(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=16))
    sim.add_request(SimRequest("a", [1, 2, 3], [3]))
    sim.step()
    sim.recorder.detach()
    assert sim.recorder not in sim.engine.step_observers and len(sim.recorder.snapshots) == 1
