"""Process groups: who talks to whom when a model is split over ranks.

Mirrors `vllm/distributed/parallel_state.py`, with its names. After

    init_distributed_environment(world_size=4, rank=r, distributed_init_method="tcp://127.0.0.1:29500")
    initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)

each process holds two groups. Ranks are laid out TP-major (vLLM's layout):

    world ranks      0  1 | 2  3
    TP groups       [0, 1]  [2, 3]       one per pipeline stage: all-reduce every layer
    PP groups       [0, 2]  [1, 3]       one per TP rank: stage s sends to stage s + 1

`get_tp_group()` / `get_pp_group()` return this process's `GroupCoordinator`s. Before
`initialize_model_parallel` (one process: the `UniProcExecutor`), both are a group of one:
every collective returns its input untouched, with no process group and no copy.
On GPUs the TP group's small bf16 all-reduces go through symmetric memory
(`symm_mem.SymmMemCommunicator`), the rest through NCCL; `set_custom_all_reduce(False)` (the
engine's `disable_custom_all_reduce`) leaves NCCL doing all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minivllm.distributed.symm_mem import SymmMemCommunicator

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer before torch.distributed gives up. A rank that
# died closes its sockets and its peers fail at once; this bounds the rarer hang (a live
# rank that never reaches the collective).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long a shutdown waits for NCCL's teardown before leaving it to a background thread, and
# how long the next engine in the same process waits for that thread (see _abort_nccl_world).
NCCL_SHUTDOWN_WAIT_S = 1
NCCL_TEARDOWN_TIMEOUT_S = 60
_PENDING_ABORT: threading.Thread | None = None


class GroupCoordinator:
    """One process group as seen from one of its ranks (vLLM's class of the same name).

    Args:
        ranks: the global ranks in this group, in group order.
        rank: this process's global rank (must be in `ranks`, unless the group is not ours).
        device_group: the torch.distributed group, or None for a group of one.
    """

    def __init__(self, ranks: list[int], rank: int, device_group: dist.ProcessGroup | None,
                 symm_mem: SymmMemCommunicator | None = None) -> None:
        self.ranks = ranks
        self.rank = rank
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = device_group
        self.symm_mem = symm_mem  # the custom all-reduce of small GPU tensors, if any

    # ------------------------------------------------------------------ positions
    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over the group: the result, in place or new. A group of one returns `input_` itself."""
        if self.world_size == 1:
            return input_
        if self.symm_mem is not None and self.symm_mem.should_use(input_):
            return self.symm_mem.all_reduce(input_)
        dist.all_reduce(input_, group=self.device_group)
        return input_

    def fused_peers(self, input_: torch.Tensor) -> tuple | None:
        """The symmetric-memory addresses a fused all-reduce kernel uses (`SymmMemCommunicator.
        fused_peers`); None for one rank, no symmetric memory or a tensor too big for the
        kernel: the same answer on every rank, which see the same shapes."""
        if self.world_size == 1 or self.symm_mem is None:
            return None
        return self.symm_mem.fused_peers(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `input_` along `dim` (same shape on every rank)."""
        if self.world_size == 1:
            return input_
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate along `dim` on group rank `dst` only (others get None): cheaper than
        all_gather when one rank alone needs the result (the logits, for the sampler)."""
        if self.world_size == 1:
            return input_
        is_dst = self.rank_in_group == dst
        parts = [torch.empty_like(input_) for _ in range(self.world_size)] if is_dst else None
        dist.gather(input_.contiguous(), parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if is_dst else None

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `input_` on every rank with group rank `src`'s, in place (the sampled
        tokens of a multi-step run: only TP rank 0 samples, every rank feeds them back)."""
        if self.world_size > 1:
            dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
        return input_

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)

    # ------------------------------------------------------------------ point to point
    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Send named tensors to group rank `dst` (default: the next stage).

        First the metadata (names, shapes, dtypes) as one pickled object, so the receiver can
        allocate; then each tensor. Every stage of a step runs the same batch, but the number
        of tokens changes from step to step, so shapes travel each time.
        """
        dst_rank = self.next_rank if dst is None else self.ranks[dst]
        metadata = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        dist.send_object_list([metadata], dst=dst_rank, group=self.device_group, device=self._object_device())
        for tensor in tensors.values():
            dist.send(tensor.contiguous(), dst=dst_rank, group=self.device_group)

    def recv_tensor_dict(self, src: int | None = None, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Receive what `send_tensor_dict` sent from group rank `src` (default: the previous stage)."""
        src_rank = self.prev_rank if src is None else self.ranks[src]
        box: list = [None]
        dist.recv_object_list(box, src=src_rank, group=self.device_group, device=self._object_device())
        device = device or self._object_device() or torch.device("cpu")
        tensors = {}
        for name, shape, dtype in box[0]:
            tensors[name] = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensors[name], src=src_rank, group=self.device_group)
        return tensors

    def _object_device(self) -> torch.device | None:
        """NCCL moves pickled objects through the current GPU; gloo through the CPU."""
        if dist.get_backend(self.device_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def destroy(self) -> None:
        if self.symm_mem is not None:
            self.symm_mem.close()
            self.symm_mem = None
        if self.device_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.device_group)
        self.device_group = None


# Both groups before initialize_model_parallel: one rank, no torch.distributed group.
_SINGLE_RANK = GroupCoordinator([0], 0, None)
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_ENABLE_CUSTOM_ALL_REDUCE = True


def set_custom_all_reduce(enable: bool) -> None:
    """Whether TP groups made after this call on GPUs all-reduce small tensors through
    symmetric memory (vLLM's function of the same name; the engine's `disable_custom_all_reduce`)."""
    global _ENABLE_CUSTOM_ALL_REDUCE
    _ENABLE_CUSTOM_ALL_REDUCE = enable


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group (a group of one when running in one process)."""
    return _TP if _TP is not None else _SINGLE_RANK


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline-parallel group (a group of one when running in one process)."""
    return _PP if _PP is not None else _SINGLE_RANK


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    return get_pp_group().rank_in_group


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str,
                                 local_rank: int = 0, backend: str | None = None) -> None:
    """Join the world: every rank calls this with the same `distributed_init_method`
    ("tcp://host:port", the rendezvous) and blocks until all `world_size` ranks arrive.

    backend: "nccl" for GPUs, "gloo" for CPUs; None picks by whether CUDA is available.
    """
    wait_for_pending_teardown()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; shut the other "
                           "engine down first (one distributed engine per process).")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # As vLLM does: NCCL's cuMem buffers cost 1-2 GiB more with all-reduces inside CUDA
        # graphs (NVIDIA/nccl#1234). Read when this process creates its first communicator.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    logger.info("rank %d/%d joining %s over %s (local rank %d)", rank, world_size, distributed_init_method,
                backend, local_rank)
    dist.init_process_group(backend=backend, init_method=distributed_init_method, world_size=world_size,
                            rank=rank, timeout=COLLECTIVE_TIMEOUT)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              backend: str | None = None) -> None:
    """Create the TP and PP groups (see the module docstring for the layout).

    Every rank must call `new_group` for every group, its own or not: torch.distributed
    creates groups collectively.
    """
    global _TP, _PP
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp * pp != world_size:
        raise ValueError(f"tensor ({tp}) x pipeline ({pp}) parallel sizes must equal the world size {world_size}.")
    backend = backend or dist.get_backend()
    tp_groups = [list(range(stage * tp, (stage + 1) * tp)) for stage in range(pp)]
    pp_groups = [list(range(tp_rank, world_size, tp)) for tp_rank in range(tp)]
    custom_all_reduce = _ENABLE_CUSTOM_ALL_REDUCE and backend == "nccl" and tp > 1
    _TP = _make_group(tp_groups, rank, backend, custom_all_reduce)
    _PP = _make_group(pp_groups, rank, backend)


def _make_group(all_ranks: list[list[int]], rank: int, backend: str,
                custom_all_reduce: bool = False) -> GroupCoordinator:
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, backend=backend, timeout=COLLECTIVE_TIMEOUT)
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, group)
    # After every group exists: the buffer's rendezvous is a collective of this group alone.
    if custom_all_reduce:
        mine.symm_mem = SymmMemCommunicator(mine.device_group, torch.device("cuda", torch.cuda.current_device()))
    return mine


def destroy_model_parallel() -> None:
    global _TP, _PP
    for group in (_TP, _PP):
        if group is not None:
            group.destroy()
    _TP = _PP = None


def destroy_distributed_environment() -> None:
    """Leave the world (so this process can later join another one, e.g. the next engine)."""
    global _TP, _PP
    if _PENDING_ABORT is not None and _PENDING_ABORT.is_alive():  # already leaving (torch clears its state last)
        _TP = _PP = None
        return
    if dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_abort_process_group"):
        _abort_nccl_world()
        _TP = _PP = None
        return
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _abort_nccl_world() -> None:
    """Abort every NCCL communicator in a background thread; wait for it only briefly.

    A graceful teardown (ncclCommDestroy) finalizes with the peers, and can hang there. Abort
    is local and clears torch's registry of groups (so a later engine can join a new world),
    but it can take seconds, and it can wait on a communicator whose peer left in the middle
    of a collective (an engine shutting down after an error). So a shutdown never waits for it
    past NCCL_SHUTDOWN_WAIT_S; the next `init_distributed_environment` in this process waits
    for it instead (up to NCCL_TEARDOWN_TIMEOUT_S), since it needs the registry cleared.
    """
    global _PENDING_ABORT

    def abort() -> None:
        start = time.monotonic()
        c10d._abort_process_group()
        logger.info("NCCL teardown finished after %.1f s", time.monotonic() - start)

    _PENDING_ABORT = threading.Thread(target=abort, name="nccl-abort", daemon=True)
    _PENDING_ABORT.start()
    _PENDING_ABORT.join(NCCL_SHUTDOWN_WAIT_S)


def wait_for_pending_teardown() -> None:
    """Let the last engine's NCCL teardown (see `_abort_nccl_world`) finish: before joining a new
    world, and before any engine of this process measures free GPU memory."""
    if _PENDING_ABORT is None or not _PENDING_ABORT.is_alive():
        return
    logger.info("waiting for the previous engine's NCCL teardown")
    _PENDING_ABORT.join(NCCL_TEARDOWN_TIMEOUT_S)
    if _PENDING_ABORT.is_alive():
        raise RuntimeError(f"the previous engine's NCCL teardown did not finish within {NCCL_TEARDOWN_TIMEOUT_S} s; "
                           "this process cannot join another distributed world (start a new process).")
