"""Block pictures: drawing a real BlockSpaceManager state puts the expected artists on an Axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from minivllm.core.block_manager import BlockSpaceManager  # noqa: E402
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus  # noqa: E402
from minivllm.viz.blocks import (  # noqa: E402
    block_state,
    draw_block_pool,
    draw_block_tables,
    draw_block_usage,
    draw_free_lists,
    draw_hash_chain,
    draw_ref_counts,
    short_hash,
)
from minivllm.viz.snapshot import snapshot_block_manager  # noqa: E402
from minivllm.viz.style import COLORS  # noqa: E402

BLOCK_SIZE = 4


@pytest.fixture()
def forked_state():
    """seq 0 (6 tokens) forked into seq 1; seq 0 then wrote a token (copy-on-write)."""
    bm = BlockSpaceManager(BLOCK_SIZE, 6, 4, watermark=0.0, enable_caching=True)
    parent = Sequence(0, None, [10, 11, 12, 13, 14, 15], BLOCK_SIZE)
    group = SequenceGroup("r", [parent])
    bm.allocate(group)
    group.set_status(SequenceStatus.RUNNING)
    parent.data.num_computed_tokens = 6
    bm.mark_blocks_as_computed(group)  # as the scheduler does for a scheduled prefill
    child = parent.fork(1)
    group.add(child)
    bm.fork(parent, child)
    parent.append_token_id(16, {})
    cows = bm.append_slots(parent)
    return bm, group, cows


def rectangles_with_color(ax, role):
    target = mcolors.to_rgba(COLORS[role])
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_facecolor() == target]


def texts(ax):
    return [t.get_text() for t in ax.texts]


def test_block_state_roles(forked_state):
    bm, group, cows = forked_state
    snap = snapshot_block_manager(bm, group.get_seqs())
    shared = bm.get_block_table(group.seqs[1])[0]
    assert block_state(snap.gpu_blocks[shared]) == "shared"
    assert block_state(snap.gpu_blocks[cows[0][1]]) == "used"
    assert block_state(snap.gpu_blocks[5]) == "free"


def test_block_tables_picture_has_every_slot_and_one_arrow_per_logical_block(forked_state):
    bm, group, cows = forked_state
    snap = snapshot_block_manager(bm, group.get_seqs())
    fig, ax = plt.subplots()
    draw_block_tables(snap, ax, token_labels={10: "The"}, copied=[cows[0][1]])
    plt.close(fig)
    num_logical = sum(len(t) for t in snap.gpu_block_tables.values())
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == num_logical == 4
    # slots: every logical block and every GPU block is drawn as BLOCK_SIZE cells
    cells = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]
    assert len(cells) == (num_logical + snap.num_gpu_blocks) * BLOCK_SIZE
    # block 0 is full and computed: registered in the prefix cache while in use -> outlined
    outlines = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(outlines) == sum(b.cached and b.ref_count > 0 for b in snap.gpu_blocks) == 1
    labels = texts(ax)
    assert "seq 0" in labels and "seq 1" in labels and "ref 2" in labels
    assert f"table {bm.get_block_table(group.seqs[0])}" in labels
    assert labels.count("The") == 3  # two logical views of block 0 + the physical block
    assert len(rectangles_with_color(ax, "shared")) == BLOCK_SIZE  # one shared block: 4 cells
    assert len(rectangles_with_color(ax, "copied")) == 3  # the CoW copy holds 3 tokens


def test_long_tokens_stay_legible_and_arrows_run_beneath_the_blocks(forked_state):
    bm, group, cows = forked_state
    snap = snapshot_block_manager(bm, group.get_seqs())
    fig, ax = plt.subplots()
    draw_block_tables(snap, ax, token_labels={10: "mathematician", 11: "Enigma"})
    plt.close(fig)
    labels = texts(ax)
    # cut to what fits its cell at a legible size, never shrunk until it overlaps its neighbours
    assert "mathe…" in labels and "mathematician" not in labels and "Enigma" in labels
    token_texts = [t for t in ax.texts if t.get_text() in ("mathe…", "Enigma")]
    assert token_texts and min(t.get_fontsize() for t in token_texts) >= 5.0
    # arrows leave a block's top or bottom edge and pass beneath the (opaque) blocks
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    cells = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert max(a.get_zorder() for a in arrows) < min(c.get_zorder() for c in cells)
    assert all(c.get_facecolor()[3] == 1.0 for c in cells if c.get_fill())
    edges = {round(c.get_y(), 6) for c in cells} | {round(c.get_y() + c.get_height(), 6) for c in cells}
    assert all(round(a._posA_posB[0][1], 6) in edges for a in arrows)


def test_pool_columns_are_balanced(forked_state):
    bm, group, _ = forked_state
    snap = snapshot_block_manager(bm, group.get_seqs())
    fig, ax = plt.subplots()
    draw_block_pool(snap, ax, rows_per_column=4)  # 6 blocks: 2 columns of 3, not 4 + 2
    plt.close(fig)
    numbers = [t for t in ax.texts if t.get_text().startswith("#")]
    assert len(numbers) == 6
    assert len({round(t.get_position()[1], 6) for t in numbers}) == 3
    assert len({round(t.get_position()[0], 6) for t in numbers}) == 2


def test_swapped_sequences_point_at_the_cpu_pool(forked_state):
    bm, group, _ = forked_state
    bm.swap_out(group)
    group.set_status(SequenceStatus.SWAPPED)
    snap = snapshot_block_manager(bm, group.get_seqs())
    fig, ax = plt.subplots()
    draw_block_tables(snap, ax)
    plt.close(fig)
    assert "CPU blocks (swap)" in texts(ax) and any("(swapped)" in t for t in texts(ax))
    cells = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]
    assert len(cells) == (4 + snap.num_gpu_blocks + snap.num_cpu_blocks) * BLOCK_SIZE


def test_pool_free_lists_and_ref_counts(forked_state):
    bm, group, _ = forked_state
    snap = snapshot_block_manager(bm, group.get_seqs())
    fig, axes = plt.subplots(1, 3)
    draw_block_pool(snap, axes[0])
    draw_free_lists(snap, axes[1])
    draw_ref_counts(snap, axes[2])
    plt.close(fig)
    assert sum(t.startswith("#") for t in texts(axes[0])) == snap.num_gpu_blocks
    assert f"GPU free ({len(snap.free_gpu_block_ids)})" in texts(axes[1])
    heights = [p.get_height() for p in axes[2].patches]
    assert heights == [b.ref_count for b in snap.gpu_blocks] and max(heights) == 2
    with pytest.raises(ValueError):
        draw_block_pool(snap, axes[0], device="tpu")


def test_hash_chain_labels_each_block_hash(forked_state):
    bm, group, _ = forked_state
    bm.mark_blocks_as_computed(group)
    snap = snapshot_block_manager(bm, group.get_seqs())
    fig, ax = plt.subplots()
    draw_hash_chain(snap, 1, ax)
    plt.close(fig)
    first = snap.gpu_blocks[snap.gpu_block_tables[1][0]]
    assert first.cached and f"#{first.block_number}  h={short_hash(first.block_hash)}" in texts(ax)
    assert short_hash(None) == "-" and len(short_hash(123456789)) == 4
    assert len(rectangles_with_color(ax, "cached")) == BLOCK_SIZE


def test_block_usage_over_a_trace(forked_state):
    bm, group, _ = forked_state
    snaps = [snapshot_block_manager(bm, group.get_seqs())]
    for seq in group.get_seqs():
        bm.free(seq)
        snaps.append(snapshot_block_manager(bm, group.get_seqs()))
    fig, ax = plt.subplots()
    draw_block_usage(snaps, ax)
    plt.close(fig)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["referenced", "cached", "free", "hit rate"]
    assert len(ax.collections) == 3  # one stacked band per state
