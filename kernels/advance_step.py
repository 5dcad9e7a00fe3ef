"""The next decode step's inputs in one kernel: multi-step's `advance_step`.

Mirrors vLLM's `advance_step_flashattn` (`csrc/prepare_inputs/advance_step.cu`); the spec is
`AdvanceStep.forward_native` (`minivllm/worker/multi_step_model_runner.py`). Per sequence (row),
between two steps of a run:

    positions, seq_lens, limits   [num_seqs]                  int64, int32, int64
    block_tables                  [num_seqs, max_blocks]      int32
    active = limits > step        a row still inside the slots its blocks hold
    position' = position + active,  seq_len' = seq_len + active
    slot'     = block_tables[row, position' // BLOCK_SIZE] * BLOCK_SIZE + position' % BLOCK_SIZE,
                or -1 (write nowhere) for a row that is not active

In PyTorch that is a dozen launches of a few microseconds each, on the device's critical path
between two CUDA-graph replays; here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 128  # rows per program


@triton.jit(do_not_specialize=["step", "num_seqs", "stride_bt"])
def _advance_step_kernel(
    positions_out_ptr, seq_lens_out_ptr, slot_mapping_out_ptr,
    positions_ptr, seq_lens_ptr, block_tables_ptr, limits_ptr,
    step, num_seqs, stride_bt,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = rows < num_seqs
    active = tl.load(limits_ptr + rows, mask=mask, other=0) > step
    position = tl.load(positions_ptr + rows, mask=mask, other=0) + active.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + rows, mask=mask, other=0) + active.to(tl.int32)
    block = tl.load(block_tables_ptr + rows.to(tl.int64) * stride_bt + position // BLOCK_SIZE,
                    mask=mask & active, other=0).to(tl.int64)
    slot = tl.where(active, block * BLOCK_SIZE + position % BLOCK_SIZE, -1)
    tl.store(positions_out_ptr + rows, position, mask=mask)
    tl.store(seq_lens_out_ptr + rows, seq_len, mask=mask)
    tl.store(slot_mapping_out_ptr + rows, slot, mask=mask)


def advance_step(positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 limits: torch.Tensor, step: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, seq_lens, slot_mapping) of step `step`, new tensors, from step - 1's.
    Shapes and dtypes as in the module docstring; block_tables unit stride along a row."""
    num_seqs = positions.shape[0]
    if not (seq_lens.shape == limits.shape == (num_seqs,) and block_tables.shape[0] == num_seqs):
        raise ValueError("positions, seq_lens, limits and block_tables need one row per sequence.")
    if block_tables.stride(1) != 1 or not all(t.is_contiguous() for t in (positions, seq_lens, limits)):
        raise ValueError("block_tables must have unit stride along a row, and positions, seq_lens and limits "
                         "must be contiguous.")
    new_positions, new_seq_lens = torch.empty_like(positions), torch.empty_like(seq_lens)
    slot_mapping = torch.empty(num_seqs, dtype=torch.int64, device=positions.device)
    if num_seqs:
        _advance_step_kernel[(triton.cdiv(num_seqs, _ROWS),)](
            new_positions, new_seq_lens, slot_mapping, positions, seq_lens, block_tables, limits,
            step, num_seqs, block_tables.stride(0), BLOCK_SIZE=block_size, ROWS=_ROWS, num_warps=4,
        )
    return new_positions, new_seq_lens, slot_mapping
