"""What a connector to a shared key-value store does, whatever the store (files, Redis).

Scheduler side: a request's prompt blocks get their chain keys (`keys.block_digests`); the
leading ones that every tensor-parallel shard has in the store are matches; the blocks a step
computes are listed for saving. Worker side: each block is one value, all of this rank's
layers, framed with its own key and a checksum:

    b"MVKVBLK2" | key length (u16) | payload length (u64) | crc32 of key + payload (u32)
                | key (utf-8) | payload (raw K/V bytes)

A value that is missing, short, too long, or fails its checksum is a load error; one whose key
is not the key asked for (a block file swapped or copied in, a store of another model, dtype
or layout) is a load error counted as `num_key_mismatches`. Either way the block is recomputed,
with a warning. A store that stops answering (a dead Redis, a full disk) is skipped for
`retry_interval_s` seconds at a time: requests recompute, the engine goes on.
"""

from __future__ import annotations

import functools
import logging
import struct
import time
import zlib
from abc import abstractmethod
from typing import Any

import torch

from minivllm.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorRole, ReqMeta,
                                                   Timer)
from minivllm.distributed.kv_transfer.keys import block_digests, model_identity, request_root, shard_name
from minivllm.distributed.kv_transfer.layerwise import LayerwiseConnectorMixin, LayerwiseTransfer

logger = logging.getLogger(__name__)

MAGIC = b"MVKVBLK2"
_HEADER = struct.Struct("<HQI")  # key length, payload length, crc32 of key + payload
_MAX_KEY_BYTES = 1024  # a key is three short parts; a longer one is not ours
_DEFAULT_RETRY_INTERVAL_S = 5.0


def encode_block(block: torch.Tensor, key: str) -> bytes:
    """One block [num_layers, 2, block_size, heads, head_dim] and its store key -> framed bytes."""
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    key_bytes = key.encode()
    header = _HEADER.pack(len(key_bytes), len(payload), zlib.crc32(payload, zlib.crc32(key_bytes)))
    return MAGIC + header + key_bytes + payload


def framed_bytes(shape: tuple[int, ...], dtype: torch.dtype, key: str) -> int:
    """The size of a framed block: what a store reads at most for one value."""
    return len(MAGIC) + _HEADER.size + len(key.encode()) + torch.Size(shape).numel() * dtype.itemsize


def unframe(data: bytes | None) -> tuple[str, bytes] | None:
    """Framed bytes -> (the key they name, the payload), or None if not whole and intact."""
    head = len(MAGIC) + _HEADER.size
    if data is None or len(data) < head or data[:len(MAGIC)] != MAGIC:
        return None
    key_length, length, crc = _HEADER.unpack(data[len(MAGIC):head])
    key_bytes, payload = data[head:head + key_length], data[head + key_length:]
    if key_length > _MAX_KEY_BYTES or len(payload) != length or zlib.crc32(payload, zlib.crc32(key_bytes)) != crc:
        return None
    try:
        return key_bytes.decode(), payload
    except UnicodeDecodeError:
        return None


def decode_block(data: bytes | None, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """Framed bytes -> the block, or None unless they are a whole, intact block of `shape`
    stored under `key` (the frame's own key: a file swapped or copied in names another)."""
    framed = unframe(data)
    if framed is None or framed[0] != key:
        return None
    payload = framed[1]
    if len(payload) != torch.Size(shape).numel() * dtype.itemsize:
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


class KVStore:
    """A key -> bytes store. `errors`: the exceptions that mean "the store is unavailable"."""

    errors: tuple[type[BaseException], ...] = (OSError,)

    @abstractmethod
    def exists(self, keys: list[str]) -> bool:
        """Do all `keys` exist?"""

    @abstractmethod
    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The value, or None if there is none or it is longer than `max_bytes` (never read
        whole then); a read also counts as a use, for LRU."""

    @abstractmethod
    def put_many(self, items: list[tuple[str, bytes]]) -> int:
        """Store every (key, value); a key already there is only marked as used. Returns how
        many are now in the store (a write it refused or that failed is not counted)."""


class StoreConnector(LayerwiseConnectorMixin, KVConnectorBase):
    """A connector over a `KVStore`; subclasses say which (`make_store`)."""

    def __init__(self, engine_config: Any, role: KVConnectorRole) -> None:
        super().__init__(engine_config, role)
        parallel = engine_config.parallel_config
        self.shards = [shard_name(r, parallel.tensor_parallel_size) for r in range(parallel.tensor_parallel_size)]
        self.shard = shard_name(parallel.tp_rank, parallel.tensor_parallel_size)  # the worker's own
        self.retry_interval_s = float(self.extra_config.get("retry_interval_s", _DEFAULT_RETRY_INTERVAL_S))
        self.store = self.make_store()
        self._unavailable_until = 0.0
        # Scheduler side: request id -> its prompt blocks' refs, "<identity>/<digest>" (the
        # workers take the identity from the refs: one fingerprint per engine, not per rank).
        self._digests: dict[str, list[str]] = {}
        self._loads: dict[str, list[tuple[int, str]]] = {}
        # Worker side.
        self._load_errors: set[int] = set()
        self._save_keys: list[str] = []

    @abstractmethod
    def make_store(self) -> KVStore:
        """The store this connector talks to."""

    @functools.cached_property
    def root(self) -> str:
        """The model's identity (`keys.model_identity`), hashed from its weights on first use
        (scheduler side only): the workers have loaded (and, for a hub id, downloaded) them by then."""
        return model_identity(self.engine_config)

    # ------------------------------------------------------------------ store calls
    def _call(self, what: str, fn, *args, default=None):
        """`fn(*args)`, or `default` while the store is unavailable (one warning per outage)."""
        now = time.monotonic()
        if now < self._unavailable_until:
            return default
        try:
            return fn(*args)
        except self.store.errors as error:
            logger.warning("KV store unavailable (%s: %r); recomputing instead, retrying in %.0f s",
                           what, error, self.retry_interval_s)
            self._unavailable_until = now + self.retry_interval_s
            return default

    @staticmethod
    def _key(shard: str, ref: str) -> str:
        """A block's store key: its ref "<identity>/<digest>" with the shard between."""
        identity, digest = ref.split("/")
        return f"{identity}/{shard}/{digest}"

    # ==================================================================== scheduler side
    def _request_digests(self, request: Any) -> list[str]:
        if request.request_id not in self._digests:
            tokens = request.first_seq.get_token_ids()
            root = request_root(self.root, getattr(request, "lora_request", None))
            digests = block_digests(tokens, self.block_size, root)
            self._digests[request.request_id] = [f"{self.root}/{digest}" for digest in digests]
        return self._digests[request.request_id]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.is_consumer:
            return 0, False
        self._digests.pop(request.request_id, None)  # (re)admission: its tokens may have grown
        def is_held(digest: str) -> bool:  # every shard's copy of the block
            keys = [self._key(shard, digest) for shard in self.shards]
            return self._call("exists", self.store.exists, keys, default=False)

        return self._leading_tokens_held(self._request_digests(request), num_computed_tokens, is_held), False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        digests = self._request_digests(request)
        start = request.first_seq.get_num_computed_tokens() // self.block_size
        end = start + num_external_tokens // self.block_size
        self._loads[request.request_id] = [(i, digests[i]) for i in range(start, end)]

    def build_connector_meta(self, scheduler_outputs: Any) -> KVConnectorMetadata:
        meta = KVConnectorMetadata()
        for scheduled in scheduler_outputs.scheduled_seq_groups:
            request = scheduled.seq_group
            load = self._loads.pop(request.request_id, [])
            save = self._blocks_to_save(scheduled) if self.is_producer else []
            if load or save:
                meta.requests.append(ReqMeta(request.request_id, load, save))
        self._loads.clear()
        return meta

    def _blocks_to_save(self, scheduled: Any) -> list[tuple[int, str]]:
        """Prompt blocks that become full and computed in this step."""
        request = scheduled.seq_group
        if not request.is_prefill():
            return []
        digests = self._request_digests(request)
        computed = request.first_seq.get_num_computed_tokens()
        first, end = computed // self.block_size, (computed + scheduled.token_chunk_size) // self.block_size
        return [(i, digests[i]) for i in range(first, min(end, len(digests)))]

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._digests.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # ==================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.transfer = LayerwiseTransfer(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        saves = [(block_id, digest) for r in connector_metadata.requests
                 for block_id, (_, digest) in zip(r.save_block_ids, r.save)]
        self._save_keys = [self._key(self.shard, digest) for _, digest in saves]
        self.transfer.start_save([block_id for block_id, _ in saves])

    def start_load_kv(self) -> None:
        self._load_errors = set()
        block_ids, blocks, mismatched = [], [], set()
        with Timer(self.stats, "load_time_s"):
            for r in self._get_connector_metadata().requests:
                for block_id, (_, digest) in zip(r.load_block_ids, r.load):
                    key = self._key(self.shard, digest)
                    max_bytes = framed_bytes(self.transfer.block_shape, self.transfer.dtype, key)
                    data = self._call("get", self.store.get, key, max_bytes)
                    block = decode_block(data, key, self.transfer.block_shape, self.transfer.dtype)
                    if block is None:
                        self._load_errors.add(block_id)
                        framed = unframe(data)
                        if framed is not None and framed[0] != key:
                            mismatched.add(block_id)
                    else:
                        block_ids.append(block_id)
                        blocks.append(block)
            if mismatched:
                logger.warning("%d KV block(s) in the store hold another key (another model, dtype, layout "
                               "or prefix: a file swapped or copied in): recomputing them", len(mismatched))
            if self._load_errors - mismatched:
                logger.warning("%d KV block(s) missing or damaged in the store: recomputing them",
                               len(self._load_errors - mismatched))
            if blocks:
                self.transfer.start_load(block_ids, torch.stack(blocks, dim=1))
        self.stats.num_load_errors += len(self._load_errors)
        self.stats.num_key_mismatches += len(mismatched)
        self._count_loaded(len(block_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_errors

    def wait_for_save(self) -> None:
        with Timer(self.stats, "save_time_s"):
            blocks = self.transfer.finish_save()
            if blocks is None:
                return
            items = [(key, encode_block(blocks[:, i], key)) for i, key in enumerate(self._save_keys)]
            saved = self._call("put", self.store.put_many, items, default=0)
        self._count_saved(saved)
