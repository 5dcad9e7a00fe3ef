"""`CPUOffloadConnector`: a second tier of KV cache in host memory.

When the paged cache overflows, the prefix cache evicts blocks, and a later request with the
same prefix recomputes them. With this connector every prompt block is also copied to a pool
of `num_cpu_blocks` host blocks (pinned, copied on a side stream on a GPU), so that request
pays a host-to-device copy instead of a recompute. (vLLM's counterparts: LMCache's CPU
backend, vLLM's `OffloadingConnector`.)

Who decides what: the scheduler side keeps the index, digest -> pool slot, least recently used
first out; it names the slots in each step's metadata. The worker side only copies, between
its cache and its own pool (each tensor-parallel rank keeps its shard at the same slot). So
the index and the pools agree without talking, and a lookup never fails. A slot being written
in a step joins the index only once that step is over (the next `schedule()`), and not at all
if its request was aborted meanwhile (a step that failed for it may not have written it).

    KVTransferConfig(kv_connector="CPUOffloadConnector", kv_role="kv_both",
                     kv_connector_extra_config={"num_cpu_blocks": 1024})
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from minivllm.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorRole, ReqMeta,
                                                   Timer)
from minivllm.distributed.kv_transfer.keys import block_digests, request_root
from minivllm.distributed.kv_transfer.layerwise import LayerwiseConnectorMixin, LayerwiseTransfer
from minivllm.sequence import SequenceStatus

_DEFAULT_NUM_CPU_BLOCKS = 512
# The chain's root: the pool lives and dies with one engine, so with one model; only adapters
# (`request_root`) need telling apart.
_POOL_ROOT = "host-pool"


class CPUOffloadConnector(LayerwiseConnectorMixin, KVConnectorBase):
    """Extra config: `num_cpu_blocks` (host pool size in blocks, default 512)."""

    def __init__(self, engine_config: Any, role: KVConnectorRole) -> None:
        super().__init__(engine_config, role)
        self.num_cpu_blocks = int(self.extra_config.get("num_cpu_blocks", _DEFAULT_NUM_CPU_BLOCKS))
        if self.num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks must be at least 1, got {self.num_cpu_blocks}.")
        self.root = _POOL_ROOT
        # Scheduler side: digest -> slot, least recently used first.
        self.index: OrderedDict[str, int] = OrderedDict()
        self.free_slots = list(range(self.num_cpu_blocks))
        self._loads: dict[str, list[tuple[int, int]]] = {}
        # Saves of the last step, by request: (digest, slot), confirmed at the next schedule().
        self._pending: dict[str, list[tuple[str, int]]] = {}

    # ==================================================================== scheduler side
    def _digests(self, request: Any) -> list[str]:
        root = request_root(self.root, getattr(request, "lora_request", None))
        return block_digests(request.first_seq.get_token_ids(), self.block_size, root)

    def _confirm_pending(self) -> None:
        """The step that wrote the pending slots is over: they may be read from now on."""
        for saves in self._pending.values():
            for digest, slot in saves:
                if digest in self.index:  # another request saved the same block meanwhile
                    self.free_slots.append(slot)
                else:
                    self.index[digest] = slot
        self._pending.clear()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._confirm_pending()
        if not self.is_consumer:
            return 0, False
        return self._leading_tokens_held(self._digests(request), num_computed_tokens, self.index.__contains__), False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        digests = self._digests(request)
        start = request.first_seq.get_num_computed_tokens() // self.block_size
        loads = []
        for i in range(start, start + num_external_tokens // self.block_size):
            self.index.move_to_end(digests[i])  # used now
            loads.append((i, self.index[digests[i]]))
        self._loads[request.request_id] = loads

    def build_connector_meta(self, scheduler_outputs: Any) -> KVConnectorMetadata:
        self._confirm_pending()
        meta = KVConnectorMetadata()
        busy = {slot for loads in self._loads.values() for _, slot in loads}  # read this step
        for scheduled in scheduler_outputs.scheduled_seq_groups:
            request = scheduled.seq_group
            load = self._loads.pop(request.request_id, [])
            save = self._slots_to_save(scheduled, busy) if self.is_producer else []
            if load or save:
                meta.requests.append(ReqMeta(request.request_id, load, save))
        self._loads.clear()
        return meta

    def _slots_to_save(self, scheduled: Any, busy: set[int]) -> list[tuple[int, int]]:
        request = scheduled.seq_group
        if not request.is_prefill():
            return []
        digests = self._digests(request)
        computed = request.first_seq.get_num_computed_tokens()
        first, end = computed // self.block_size, (computed + scheduled.token_chunk_size) // self.block_size
        saves, pending = [], self._pending.setdefault(request.request_id, [])
        for i in range(first, min(end, len(digests))):
            if digests[i] in self.index:
                self.index.move_to_end(digests[i])
                continue
            slot = self._take_slot(busy)
            if slot is None:
                break
            pending.append((digests[i], slot))
            busy.add(slot)
            saves.append((i, slot))
        return saves

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """An aborted request's unconfirmed saves are dropped: its step may have failed."""
        if request.first_seq.status == SequenceStatus.FINISHED_ABORTED:
            self.free_slots.extend(slot for _, slot in self._pending.pop(request.request_id, []))
        self._loads.pop(request.request_id, None)
        return False, None

    def _take_slot(self, busy: set[int]) -> int | None:
        """A free slot, else the least recently used one no transfer of this step touches."""
        if self.free_slots:
            return self.free_slots.pop()
        for digest, slot in self.index.items():
            if slot not in busy:
                del self.index[digest]
                return slot
        return None

    # ==================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.transfer = LayerwiseTransfer(kv_caches)
        self.pool = self.transfer.host_empty(self.num_cpu_blocks)  # [layers, slots, 2, ...]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._save_slots = [slot for r in connector_metadata.requests for _, slot in r.save]
        self.transfer.start_save([b for r in connector_metadata.requests for b in r.save_block_ids])

    def start_load_kv(self) -> None:
        requests = self._get_connector_metadata().requests
        block_ids = [b for r in requests for b in r.load_block_ids]
        slots = [slot for r in requests for _, slot in r.load]
        with Timer(self.stats, "load_time_s"):
            if block_ids:
                self.transfer.start_load(block_ids, self.pool[:, slots])
        self._count_loaded(len(block_ids))

    def wait_for_save(self) -> None:
        with Timer(self.stats, "save_time_s"):
            blocks = self.transfer.finish_save()
            if blocks is None:
                return
            self.pool[:, self._save_slots] = blocks
        self._count_saved(len(self._save_slots))
