"""The KV connector interface: how an outside KV store plugs into the scheduler and the workers.

Follows vLLM's KV connector v1 (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`): one
class, built twice, once per side (`KVConnectorRole`), with the same seven methods' names:

    scheduler side (the engine process, no tensors)      worker side (each rank, tensors)
    get_num_new_matched_tokens(request, num_computed)    bind_connector_metadata(meta)
    update_state_after_alloc(request, block_ids, n)      start_load_kv(...)
    build_connector_meta(scheduler_outputs) --meta-->    wait_for_layer_load(layer_name)   } per layer,
    request_finished(request, block_ids)                 save_kv_layer(name, kv, metadata) } in the forward
                                                         wait_for_save()

Only the `KVConnectorMetadata` built each step crosses from one side to the other, in the
step's `ExecuteModelRequest`. It names blocks by their *logical* index in the request's block
table; the worker maps them to physical ids with the step's block tables (`with_block_tables`).
A failed load is reported by `get_block_ids_with_load_errors` and recomputed in the same step.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.config import EngineConfig


class KVConnectorRole(enum.Enum):
    """Which side a connector object serves (vLLM's names)."""

    SCHEDULER = 0
    WORKER = 1


# A block to move: (index in the request's block table, where it lives in the store: a key
# string for a shared store, a slot number for the CPU offload pool).
BlockRef = tuple[int, Any]


@dataclass
class ReqMeta:
    """One request's transfers in one step.

    `load` / `save`: (logical block index, store reference) pairs. `load_block_ids` /
    `save_block_ids`: the same blocks' physical ids, filled in on the worker.
    """

    request_id: str
    load: list[BlockRef] = field(default_factory=list)
    save: list[BlockRef] = field(default_factory=list)
    load_block_ids: list[int] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the workers for one step (vLLM: the connector's own
    subclass of `KVConnectorMetadata`; one plain dataclass serves every connector here)."""

    requests: list[ReqMeta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not any(r.load or r.save for r in self.requests)

    def with_block_tables(self, block_tables: dict[str, list[int]]) -> KVConnectorMetadata:
        """A copy whose blocks carry physical ids, from each request's block table this step."""
        requests = []
        for r in self.requests:
            table = block_tables.get(r.request_id)
            if table is None:  # not in this step's batch (cannot happen: the scheduler built both)
                continue
            requests.append(replace(r, load_block_ids=[table[i] for i, _ in r.load],
                                    save_block_ids=[table[i] for i, _ in r.save]))
        return KVConnectorMetadata(requests)


@dataclass
class KVTransferStats:
    """Cumulative counts of one worker's connector (tokens, bytes, seconds), vLLM's kind of
    connector metrics. `num_load_errors`: blocks whose load failed and were recomputed;
    `num_key_mismatches`: those of them whose stored value named another key (another model,
    dtype, layout or prefix)."""

    num_tokens_loaded: int = 0
    num_tokens_saved: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_time_s: float = 0.0
    save_time_s: float = 0.0
    num_load_errors: int = 0
    num_key_mismatches: int = 0

    def copy(self) -> KVTransferStats:
        return replace(self)


class KVConnectorBase(ABC):
    """The seven methods, split by side. Subclasses implement both sides in one class (vLLM's
    layout); the factory builds one object per side with `role` saying which.

    Args:
        engine_config: the engine's configs; `kv_transfer_config` says which connector and
            role ("kv_producer" saves, "kv_consumer" loads, "kv_both" does both), and its
            `kv_connector_extra_config` carries the connector's own settings.
        role: SCHEDULER or WORKER.
    """

    def __init__(self, engine_config: EngineConfig, role: KVConnectorRole) -> None:
        self.engine_config = engine_config
        self.kv_transfer_config = engine_config.kv_transfer_config
        self.role = role
        self.extra_config: dict[str, Any] = dict(self.kv_transfer_config.kv_connector_extra_config)
        self._connector_metadata: KVConnectorMetadata | None = None
        self.stats = KVTransferStats()
        self.block_size = engine_config.cache_config.block_size

    @property
    def is_producer(self) -> bool:
        return self.kv_transfer_config.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_transfer_config.kv_role in ("kv_consumer", "kv_both")

    # ==================================================================== scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` (the local prefix-cache hits) whose KV the store
        holds, block-aligned and never the block of the prompt's last token; and whether they
        load asynchronously (always False here: they load inside the next step)."""

    def _leading_tokens_held(self, digests: list[str], num_computed_tokens: int, is_held) -> int:
        """Tokens of the blocks after the first `num_computed_tokens` that the store holds, up
        to the first it does not (a hit must continue a prefix). is_held: digest -> bool."""
        num_matched = 0
        for digest in digests[num_computed_tokens // self.block_size:]:
            if not is_held(digest):
                break
            num_matched += 1
        return num_matched * self.block_size

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got its blocks (`block_ids`, its whole table); `num_external_tokens`
        of them will be loaded from the store in this step."""

    @abstractmethod
    def build_connector_meta(self, scheduler_outputs: Any) -> KVConnectorMetadata:
        """This step's loads and saves, for the workers. Resets the per-step state."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """The request finished (or was aborted). Returns (delay_free_blocks, kv_transfer_params):
        always (False, None) here, since saves complete inside the step that computed them."""
        return False, None

    # ==================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The worker's paged caches, layer name -> `[2, num_blocks, block_size, heads, head_dim]`."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """This step's metadata (with physical block ids), before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """After the step: forget its metadata."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata bound for this step.")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin copying this step's loads into the paged cache (may return before done)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s loads are in its cache (called just before its attention)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Begin saving this step's blocks of one layer (called just after its attention wrote
        the new keys and values into `kv_layer`)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are complete (called after the forward pass)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Physical blocks of this step whose load failed (the runner recomputes them)."""
        return set()


class Timer:
    """Adds the seconds spent inside `with` to `stats.<name>`."""

    def __init__(self, stats: KVTransferStats, name: str) -> None:
        self.stats, self.name = stats, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        setattr(self.stats, self.name, getattr(self.stats, self.name) + time.perf_counter() - self.start)
