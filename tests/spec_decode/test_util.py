"""`expand_batch`: the decode rows of batch expansion (the scoring pass and the draft's catch-up)."""

from __future__ import annotations

import pytest

from minivllm.attention import build_attn_metadata
from minivllm.spec_decode.util import expand_batch


def test_each_token_is_a_row_over_its_sequences_block_table():
    input_ids, positions, tables = expand_batch([[5, 6, 7], [9]], [9, 20], [[7], [3, 5]])
    assert input_ids == [5, 6, 7, 9]
    assert positions == [9, 10, 11, 20]
    assert tables == [[7], [7], [7], [3, 5]]


def test_row_j_attends_to_the_rows_before_it():
    _, positions, tables = expand_batch([[1, 2, 3, 4]], [15], [[2, 8]])
    md = build_attn_metadata(tables, positions, [1] * len(positions), 0, 16)
    assert md.seq_lens.tolist() == [16, 17, 18, 19]
    assert md.slot_mapping.tolist() == [2 * 16 + 15, 8 * 16 + 0, 8 * 16 + 1, 8 * 16 + 2]


def test_one_entry_per_sequence_or_a_reason():
    with pytest.raises(ValueError, match="one entry per sequence"):
        expand_batch([[1]], [0, 1], [[0]])
