"""The PagedAttention pictures: the state they draw is right, and they draw one patch per slot."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minivllm.viz.paged_attention import (  # noqa: E402
    draw_attention_mask,
    draw_block_tables,
    draw_paged_cache,
    draw_split_kv,
    slot_owners,
    split_ranges,
)

BLOCK_TABLES, SEQ_LENS, BLOCK_SIZE = [[7, 2], [0, 9, 4], [5]], [5, 9, 3], 4


def test_slot_owners_follows_the_slot_formula():
    owners = slot_owners(BLOCK_TABLES, SEQ_LENS, BLOCK_SIZE)
    assert len(owners) == sum(SEQ_LENS)  # distinct blocks: no two tokens share a slot
    assert owners[7 * 4 + 3] == (0, 3) and owners[2 * 4 + 0] == (0, 4) and owners[4 * 4] == (1, 8)
    with pytest.raises(ValueError, match="cannot hold"):
        slot_owners([[1]], [5], block_size=4)


@pytest.mark.parametrize("seq_len,num_splits,tile", [(100, 4, 16), (20, 4, 16), (1, 8, 32), (4096, 9, 32)])
def test_split_ranges_cover_the_context_once_in_whole_tiles(seq_len, num_splits, tile):
    ranges = split_ranges(seq_len, num_splits, tile)
    assert 1 <= len(ranges) <= num_splits
    assert ranges[0][0] == 0 and ranges[-1][1] == seq_len
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert all(start % tile == 0 for start, _ in ranges)


def test_drawings_have_one_patch_per_slot():
    fig, axes = plt.subplots(4)
    draw_paged_cache(axes[0], BLOCK_TABLES, SEQ_LENS, BLOCK_SIZE, num_blocks=12)
    assert len(axes[0].patches) == 12 * BLOCK_SIZE
    draw_block_tables(axes[1], BLOCK_TABLES, SEQ_LENS, BLOCK_SIZE)
    assert len(axes[1].patches) == (2 + 3 + 1) * BLOCK_SIZE
    draw_attention_mask(axes[2], context_len=5, query_len=4)
    assert len(axes[2].patches) == 4 * 9
    draw_split_kv(axes[3], [100, 20], num_splits=4, tile_tokens=16)
    assert len(axes[3].patches) == 4 + 2
    plt.close(fig)
