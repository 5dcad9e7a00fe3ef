"""`SharedStorageConnector`: KV blocks as files in a folder any number of engines share.

vLLM's example connector of the same name (`.../v1/shared_storage_connector.py`) writes one
safetensors file per request; here one file per block, named by its chain key, so two requests
sharing a prefix share its files, and a prefix hit needs no request in common:

    <shared_storage_path>/<model identity>/tp<rank>of<size>/<digest[:2]>/<digest>.kv

- Atomic writes: a file is written under a temporary name and renamed (`os.replace`), so a
  reader sees a whole block or none, even with two engines writing the same block at once.
- Capacity: `max_size_gb` (extra config; unset: no limit). After each step's writes, the least
  recently used files go until the folder fits; a read marks its file used (mtime).
- A file missing (evicted by another engine between lookup and load), truncated or damaged is
  recomputed with a warning (see `store_connector`).

    KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                     kv_connector_extra_config={"shared_storage_path": "/tmp/kv", "max_size_gb": 1})
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

from minivllm.distributed.kv_transfer.store_connector import KVStore, StoreConnector

_SUFFIX = ".kv"
_GiB = 1 << 30


class FileKVStore(KVStore):
    """Files under `root`; `max_bytes` (None: unlimited) with least-recently-used eviction."""

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        prefix, _, digest = key.rpartition("/")
        return self.root / prefix / digest[:2] / (digest + _SUFFIX)

    def exists(self, keys: list[str]) -> bool:
        return all(self.path(key).is_file() for key in keys)

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        with contextlib.suppress(FileNotFoundError):  # evicted right after the read: the bytes are whole
            os.utime(path)  # used now: last in line for eviction
        return data

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        for key, data in items:
            self._put(self.path(key), data)
        if items and self.max_bytes is not None:
            self.evict(self.max_bytes)

    def _put(self, path: Path, data: bytes) -> None:
        try:
            os.utime(path)  # already there (same key, same bytes): only used now
            return
        except FileNotFoundError:  # absent, or evicted by another engine a moment ago
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)  # atomic: readers see the whole block or no file
        finally:
            temporary.unlink(missing_ok=True)

    def files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file, least recently used first."""
        found = []
        for path in self.root.rglob("*" + _SUFFIX):
            try:
                stat = path.stat()
            except FileNotFoundError:  # evicted by another engine meanwhile
                continue
            found.append((stat.st_mtime, stat.st_size, path))
        return sorted(found)

    def evict(self, max_bytes: int) -> int:
        """Delete least recently used files until at most `max_bytes` remain; returns how many."""
        files = self.files()
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in files:
            if total <= max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed += 1
        return removed


class SharedStorageConnector(StoreConnector):
    """Extra config: `shared_storage_path` (required), `max_size_gb` (default: no limit),
    `retry_interval_s` (how long to skip a failing store)."""

    def make_store(self) -> FileKVStore:
        path = self.extra_config.get("shared_storage_path")
        if not path:
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config['shared_storage_path'].")
        max_size_gb = self.extra_config.get("max_size_gb")
        if max_size_gb is not None and float(max_size_gb) < 0:
            raise ValueError(f"max_size_gb must be at least 0, got {max_size_gb}.")
        return FileKVStore(path, None if max_size_gb is None else int(float(max_size_gb) * _GiB))
