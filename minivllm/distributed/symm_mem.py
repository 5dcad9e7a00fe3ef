"""A faster all-reduce for the small tensors of decoding: `SymmMemCommunicator`.

Mirrors `vllm/distributed/device_communicators/symm_mem.py`. At tensor parallel size 2 each
decoder layer all-reduces two small `[num_tokens, hidden_size]` tensors, where NCCL's fixed
cost per call dominates. PyTorch's symmetric memory maps one buffer per rank into every peer,
so a kernel on one GPU loads its peers' buffers directly (NVLink; no multicast needed):

    one-shot   copy into the own buffer, read and sum every peer's: (world - 1) x the tensor
    two-shot   reduce-scatter then all-gather through the buffers: half the reads at 2 ranks

Both are captured in CUDA graphs like any kernel. NCCL does the rest: tensors over `MAX_BYTES`,
anything but bf16 CUDA tensors, CPUs (gloo), and every all-reduce of a world whose ranks did
not all set up symmetric memory, which they decide together (one rank in a symmetric-memory
kernel and another in NCCL would wait for each other forever). One world per process: a
second rendezvous in one process fails, so a later engine there uses NCCL. A rank whose peer
dies mid-kernel waits forever; the `mp` executor's `DeadPeerWatchdog` then ends the process,
naming the dead rank. `disable_custom_all_reduce=True` keeps NCCL for every all-reduce.
"""

from __future__ import annotations

import logging
import socket
import zlib

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 8 * 1024 * 1024  # vLLM's SymmMemCommunicator limit at 2 ranks: 1,024 rows of 4,096 bf16
# One-shot up to here (one kernel, latency-bound), two-shot above (half the bytes read per rank).
ONE_SHOT_MAX_BYTES = 64 * 1024
DTYPE = torch.bfloat16  # the buffer's type: the dtype GPUs serve in
_SET_UP_IN_THIS_PROCESS = False  # see "One world per process" above


class SymmMemCommunicator:
    """All-reduces through a symmetric-memory buffer of `max_bytes` on this rank's GPU.

    Construct it on every rank of `group` at the same time (the buffer's rendezvous is a
    collective). `disabled` is True when symmetric memory could not be set up.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        self.group_name = group.group_name
        self.disabled = True
        self.buffer: torch.Tensor | None = None
        # Every decision below is the same on every rank (an all-reduce each): a rank that
        # took NCCL while another ran a symmetric-memory kernel would leave that kernel
        # waiting for it forever.
        if not _on_every_rank(group, device, not _SET_UP_IN_THIS_PROCESS):
            logger.info("symmetric memory was set up by an earlier engine of a rank's process: "
                        "NCCL does every all-reduce of this one")
            return
        if not _on_one_machine(group, device):  # peers' memory is reachable only over NVLink / PCIe
            logger.info("the tensor-parallel group spans machines: NCCL does every all-reduce")
            return
        buffer, handle = _allocate_and_rendezvous(max_bytes, device, self.group_name)
        if not _on_every_rank(group, device, buffer is not None):
            logger.warning("symmetric memory could not be set up on every rank: NCCL does every all-reduce")
            return
        self.buffer, self.disabled = buffer, False
        # Every rank's buffer and signal pad as device addresses, for kernels that fuse a reduce.
        self.rank, self.world_size = handle.rank, handle.world_size
        self.buffer_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.signal_pad_ptrs = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        # The copy into the buffer inside the one-shot kernel, where this PyTorch has the op.
        self.one_shot_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        # Two-shot straight into the caller's tensor where this PyTorch has the op (newer ones;
        # built for 2, 4 and 8 ranks only). Elsewhere in place in the buffer, then copied out.
        self.two_shot_out = (hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out")
                             and dist.get_world_size(group) in (2, 4, 8))

    def should_use(self, tensor: torch.Tensor) -> bool:
        """bf16, on the GPU, contiguous, 16-byte aligned, a multiple of 16 bytes and no bigger
        than the buffer (the kernels move 16 bytes a thread)."""
        nbytes = tensor.numel() * tensor.element_size()
        return (not self.disabled and tensor.dtype == DTYPE and tensor.is_cuda and tensor.is_contiguous()
                and tensor.data_ptr() % 16 == 0 and nbytes % 16 == 0
                and nbytes <= self.buffer.numel() * DTYPE.itemsize)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group (call only where `should_use`): in place, or, for the
        one-shot op that copies into the buffer itself, a new tensor."""
        flat = tensor.view(-1)
        staged = self.buffer[: flat.numel()]
        if flat.numel() * DTYPE.itemsize <= ONE_SHOT_MAX_BYTES and self.one_shot_copy:
            out = torch.empty_like(flat)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, out)
            return out.view_as(tensor)
        staged.copy_(flat)
        if flat.numel() * DTYPE.itemsize <= ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        elif self.two_shot_out:
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
        return tensor

    def fused_peers(self, tensor: torch.Tensor) -> tuple | None:
        """(buffer addresses, signal-pad addresses, rank, world size, two-shot?) for a kernel
        that sums `tensor` over the group through the buffers and its own barriers
        (`kernels/custom_all_reduce.py`, which needs twice the tensor's bytes); None when
        `tensor` does not fit."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.should_use(tensor) or 2 * nbytes > self.buffer.numel() * DTYPE.itemsize:
            return None
        return self.buffer_ptrs, self.signal_pad_ptrs, self.rank, self.world_size, nbytes > ONE_SHOT_MAX_BYTES

    def close(self) -> None:
        self.buffer, self.disabled = None, True


def _allocate_and_rendezvous(max_bytes: int, device: torch.device, group_name: str) -> tuple:
    """(the buffer, its symmetric-memory handle), mapped by every peer; (None, None) and a
    warning if this rank failed."""
    global _SET_UP_IN_THIS_PROCESS
    _SET_UP_IN_THIS_PROCESS = True  # even a failed attempt leaves state behind in this process
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(max_bytes // DTYPE.itemsize, dtype=DTYPE, device=device)
        return buffer, symm_mem.rendezvous(buffer, group_name)
    except Exception as error:  # noqa: BLE001 - a private API: any failure means "use NCCL"
        logger.warning("symmetric memory unavailable on this rank (%r)", error)
        return None, None


def _on_every_rank(group: dist.ProcessGroup, device: torch.device, holds: bool) -> bool:
    """Whether `holds` is true on every rank of `group` (the same answer on each)."""
    flag = torch.tensor([1 if holds else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _on_one_machine(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether every rank of `group` runs on this machine (a Ray group may span several):
    the min of the host names' hashes and the min of their negations bound the same value."""
    host = zlib.crc32(socket.gethostname().encode())
    bounds = torch.tensor([host, -host], device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=group)
    return bool(bounds[0] == -bounds[1])
