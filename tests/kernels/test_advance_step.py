"""Multi-step's `advance_step`: the Triton kernel (`kernels/advance_step.py`) against the
PyTorch spec (`AdvanceStep.forward_native`), and the spec against a per-row loop (the definition).

Rows cross block boundaries, and some are past their reserved slots (limits <= step): those stay
where they are and write nowhere.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.worker.multi_step_model_runner import AdvanceStep

spec = AdvanceStep("torch")
NO_SLOT = -1

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_rows(num_seqs, block_size, max_blocks, step, seed):
    """positions (each with its next position inside its table), seq_lens, tables, limits."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_blocks * block_size - 1, (num_seqs,), generator=g)
    seq_lens = (positions + 1).to(torch.int32)
    tables = torch.randperm(4 * max_blocks * num_seqs, generator=g)[: num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks).to(torch.int32)
    limits = torch.randint(1, step + 3, (num_seqs,), generator=g)  # some <= step: inactive rows
    return [t.to(DEVICE) for t in (positions, seq_lens, tables, limits)]


def per_row(positions, seq_lens, tables, limits, step, block_size):
    out = ([], [], [])
    for position, seq_len, table, limit in zip(positions.tolist(), seq_lens.tolist(), tables.tolist(), limits.tolist()):
        if limit > step:
            position, seq_len = position + 1, seq_len + 1
            slot = table[position // block_size] * block_size + position % block_size
        else:
            slot = NO_SLOT
        for values, value in zip(out, (position, seq_len, slot)):
            values.append(value)
    return out


@settings(max_examples=30, deadline=None)
@given(num_seqs=st.integers(1, 40), block_size=st.sampled_from([1, 4, 16]), max_blocks=st.integers(2, 6),
       step=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_reference_is_the_per_row_definition(num_seqs, block_size, max_blocks, step, seed):
    args = random_rows(num_seqs, block_size, max_blocks, step, seed)
    got = spec(*args, step, block_size)
    assert [t.tolist() for t in got] == list(per_row(*args, step, block_size))
    assert [t.dtype for t in got] == [torch.int64, torch.int32, torch.int64]


@pytest.mark.parametrize("num_seqs, block_size, max_blocks, step, all_inactive", [
    (1, 16, 4, 1, False), (7, 4, 5, 3, False), (130, 16, 3, 2, False),  # 130 rows: two programs
    (5, 16, 3, 0, False),  # step 0 (a run continuing the last one): every row moves
    (6, 8, 3, 2, True),  # every row out of reserved slots: none moves, none writes
])
def test_kernel_matches_the_reference(num_seqs, block_size, max_blocks, step, all_inactive):
    from minivllm.kernels.advance_step import advance_step

    args = random_rows(num_seqs, block_size, max_blocks, step, seed=num_seqs)
    if all_inactive:
        args[3].fill_(step)
    for got, expected in zip(advance_step(*args, step, block_size), spec(*args, step, block_size)):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)


def test_kernel_rejects_what_it_does_not_read():
    from minivllm.kernels.advance_step import advance_step

    positions, seq_lens, tables, limits = random_rows(4, 16, 2, 1, seed=0)
    with pytest.raises(ValueError, match="one row per sequence"):
        advance_step(positions, seq_lens[:3], tables, limits, 1, 16)
    with pytest.raises(ValueError, match="unit stride"):
        advance_step(positions, seq_lens, tables.t().contiguous().t(), limits, 1, 16)
    with pytest.raises(ValueError, match="contiguous"):
        advance_step(torch.stack([positions, positions], dim=1)[:, 0], seq_lens, tables, limits, 1, 16)
