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
- Nothing outside the folder is read or written: a block file that is a link or not a regular
  file is never read (and at most one block's bytes of any file), and a folder inside the
  store that leads outside it (a symbolic link) is neither read nor written through.

    KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                     kv_connector_extra_config={"shared_storage_path": "/tmp/kv", "max_size_gb": 1})
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import uuid
from pathlib import Path

from minivllm.distributed.kv_transfer.store_connector import KVStore, StoreConnector

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_GiB = 1 << 30
# Opening a block file: never through a link at its name, never waiting on a FIFO.
_OPEN_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


class FileKVStore(KVStore):
    """Files under `root`; `max_bytes` (None: unlimited) with least-recently-used eviction."""

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()  # the folder configured may be a link; everything below it may not
        self._warned: set[Path] = set()  # folders leading outside, each reported once

    def path(self, key: str) -> Path:
        prefix, _, digest = key.rpartition("/")
        return self.root / prefix / digest[:2] / (digest + _SUFFIX)

    def _inside(self, folder: Path) -> bool:
        """Is `folder` within the store once the links on its way (those that exist) are followed?"""
        return Path(os.path.realpath(folder)).is_relative_to(self.root)

    def _is_block_file(self, path: Path) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode) and self._inside(path.parent)
        except OSError:
            return False

    def exists(self, keys: list[str]) -> bool:
        return all(self._is_block_file(self.path(key)) for key in keys)

    def get(self, key: str, max_bytes: int) -> bytes | None:
        path = self.path(key)
        try:
            if not self._inside(path.parent):
                return None
            fd = os.open(path, _OPEN_READ)
        except OSError:  # absent, or a link at the block's name (O_NOFOLLOW)
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device, a folder
                return None
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # not one block: never read whole
            return None
        with contextlib.suppress(FileNotFoundError):  # evicted right after the read: the bytes are whole
            os.utime(path, follow_symlinks=False)  # used now: last in line for eviction
        return data

    def put_many(self, items: list[tuple[str, bytes]]) -> int:
        saved = sum(self._put(self.path(key), data) for key, data in items)
        if items and self.max_bytes is not None:
            self.evict(self.max_bytes)
        return saved

    def _put(self, path: Path, data: bytes) -> bool:
        """Write one block file; False if its folder leads outside the store."""
        if not self._inside(path.parent):  # checked before mkdir, which would follow the link
            if path.parent not in self._warned:
                self._warned.add(path.parent)
                logger.warning("KV store folder %s leads outside the store %s: not writing through it",
                               path.parent, self.root)
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._is_block_file(path):  # already there (same key, same bytes): only used now
            with contextlib.suppress(FileNotFoundError):  # evicted by another engine a moment ago
                os.utime(path, follow_symlinks=False)
                return True
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with os.fdopen(os.open(temporary, _OPEN_NEW, 0o644), "wb") as f:
                f.write(data)
            os.replace(temporary, path)  # atomic: readers see the whole block or no file (a link there goes)
        finally:
            temporary.unlink(missing_ok=True)
        return True

    def files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file, least recently used first; folders that
        are links are not followed (what they hold is not the store's)."""
        found = []
        for folder, _, names in os.walk(self.root):
            for name in names:
                if not name.endswith(_SUFFIX):
                    continue
                path = Path(folder) / name
                try:
                    st = os.lstat(path)
                except FileNotFoundError:  # evicted by another engine meanwhile
                    continue
                found.append((st.st_mtime, st.st_size, path))
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
