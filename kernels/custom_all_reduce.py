"""A tensor-parallel all-reduce fused with the residual add and RMSNorm after it, in Triton.

After o_proj and down_proj each TP rank holds a partial sum; the decoder then adds the residual
and normalizes. Apart that is three kernels (copy into the symmetric buffer, all-reduce, add +
norm); here it is one, over PyTorch's symmetric memory (every rank's buffer and signal pad
mapped into every peer, `minivllm/distributed/symm_mem.py`). x, out, residual `[rows, hidden]`:

    one-shot (one program per row)         two-shot (rows spread over up to PROGRAMS programs)
    x ──> my buffer[row]                    x ──> my buffer[row]
    barrier                                 barrier
    s = sum over ranks of buffer_r[row]     rows I own (row % world == rank): s = sum over ranks
    barrier (buffers free again)                of buffer_r[row], stored into every buffer_r[rows + row]
    out = rms_norm(s + residual)            barrier (every sum in place; no peer reads mine after)
                                            out = rms_norm(buffer[rows + row] + residual)

At two ranks the two-shot moves half the rows over NVLink. Every rank gets the same bits: each
sum is taken in rank order, with the unfused chain's roundings (`all_reduce` then
`fused_ops.rms_norm`). The barrier is PyTorch's signal-pad protocol (`put_signal` /
`wait_signal`): a rank raises its flag in a peer's pad with a compare-and-swap 0 -> 1 (release,
system scope) and takes the peer's from its own with 1 -> 0 (acquire), so the pads are zero
between kernels and PyTorch's all-reduce kernels can share them. vLLM fuses the same three steps
(its all-reduce fusion pass, on FlashInfer's kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minivllm.kernels.fused_ops import add_residual_and_norm

# Every program must be resident at once (each waits for its peers'): one-shot runs one per row,
# two-shot at most PROGRAMS and two per SM (two 128-thread programs fit on any SM). A program
# uses world-size flags of each signal pad; the smallest pad PyTorch allocates holds 512.
MAX_ROWS = 64
PROGRAMS = 256
_SIGNAL_PAD_FLAGS = 512
_NUM_WARPS = 4


@triton.jit
def _barrier(signal_pad_ptrs, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Meet the program of the same `slot` on every other rank."""
    tl.debug_barrier()  # every thread's stores are issued before this program's flags go up
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            pad = tl.load(signal_pad_ptrs + peer).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(pad + slot * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    own_pad = tl.load(signal_pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(own_pad + slot * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads a peer's buffer before the flags are taken


@triton.jit
def _buffer(buffer_ptrs, rank, dtype: tl.constexpr):
    """Rank `rank`'s buffer as a pointer. Symmetric-memory buffers are 16-byte aligned; saying
    so lets loads and stores move 16 bytes a thread, not 2 (2.4x faster at 256 rows)."""
    return tl.multiple_of(tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _one_shot_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    buffer_ptrs, signal_pad_ptrs,  # int64 [WORLD]: each rank's buffer and signal pad, as addresses
    stride_x, stride_r, stride_o, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)  # also the signal-pad slot this row's barriers use
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    own_buffer = _buffer(buffer_ptrs, RANK, dtype)
    tl.store(own_buffer + row * N + cols, x, mask=mask)
    _barrier(signal_pad_ptrs, row, RANK, WORLD)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):  # the same order on every rank: the same bits
        buffer = _buffer(buffer_ptrs, rank, dtype)
        total += tl.load(buffer + row * N + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
    _barrier(signal_pad_ptrs, row, RANK, WORLD)
    x = total.to(dtype)  # the all-reduce's result, rounded as the unfused all-reduce rounds it
    add_residual_and_norm(x, row, cols, mask, out_ptr, residual_out_ptr, residual_ptr, weight_ptr,
                          stride_r, stride_o, eps, N, True)


@triton.jit
def _two_shot_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, buffer_ptrs, signal_pad_ptrs,
    rows, stride_x, stride_r, stride_o, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
):
    program, programs = tl.program_id(0), tl.num_programs(0)  # program: its barriers' slot
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty
    own_buffer = _buffer(buffer_ptrs, RANK, dtype)
    sums = rows * N  # the buffers' second half: each row's sum over the ranks
    for row in range(program, rows, programs):
        tl.store(own_buffer + row * N + cols, tl.load(x_ptr + row * stride_x + cols, mask=mask), mask=mask)
    _barrier(signal_pad_ptrs, program, RANK, WORLD)
    for row in range(program, rows, programs):
        if row % WORLD == RANK:  # the rows this rank sums for every rank
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for rank in tl.static_range(WORLD):  # the same order on every rank: the same bits
                buffer = _buffer(buffer_ptrs, rank, dtype)
                total += tl.load(buffer + row * N + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
            for rank in tl.static_range(WORLD):
                buffer = _buffer(buffer_ptrs, rank, dtype)
                tl.store(buffer + sums + row * N + cols, total.to(dtype), mask=mask)
    _barrier(signal_pad_ptrs, program, RANK, WORLD)
    for row in range(program, rows, programs):
        x = tl.load(own_buffer + sums + row * N + cols, mask=mask, other=0.0, volatile=True)
        add_residual_and_norm(x, row, cols, mask, out_ptr, residual_out_ptr, residual_ptr, weight_ptr,
                              stride_r, stride_o, eps, N, True)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buffer_ptrs: torch.Tensor, signal_pad_ptrs: torch.Tensor, rank: int,
                            world_size: int, two_shot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual).

    x `[rows, N]` with unit last stride; each rank's buffer holds twice x's size. One-shot
    unless `two_shot` or over MAX_ROWS rows. Call it on every rank of the group with the same
    shapes and schedule (it waits for them).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"all_reduce_add_rms_norm takes a 2-D x with unit last stride, "
                         f"got {tuple(x.shape)} with strides {x.stride()}.")
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual must be shaped like x {tuple(x.shape)} with unit last stride.")
    rows, n = x.shape
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    if not rows:
        return out, residual_out
    if two_shot or rows > MAX_ROWS:
        _two_shot_kernel[(min(rows, _max_programs(x.device, world_size)),)](
            out, residual_out, x, residual, weight, buffer_ptrs, signal_pad_ptrs,
            rows, x.stride(0), residual.stride(0), out.stride(0), eps,
            RANK=rank, WORLD=world_size, N=n, BLOCK=triton.next_power_of_2(n), num_warps=_NUM_WARPS,
        )
    else:
        _one_shot_kernel[(rows,)](
            out, residual_out, x, residual, weight, buffer_ptrs, signal_pad_ptrs,
            x.stride(0), residual.stride(0), out.stride(0), eps,
            RANK=rank, WORLD=world_size, N=n, BLOCK=triton.next_power_of_2(n), num_warps=_NUM_WARPS,
        )
    return out, residual_out


def _max_programs(device: torch.device, world_size: int) -> int:
    """Two-shot's most programs: PROGRAMS, the signal pads' flags, and on a GPU two per SM."""
    most = min(PROGRAMS, _SIGNAL_PAD_FLAGS // world_size)
    if device.type != "cuda":
        return most
    return min(most, 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    """The GPU's SM count, asked once (the launch path runs twice a layer)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
