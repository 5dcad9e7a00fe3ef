"""A model's identity from its weights: a digest of the checkpoint files' bytes.

A stored KV block is reusable only by the model that computed it, and a path names a place,
not a model: two checkpoints reached by one relative path, or a checkpoint replaced in place,
are two models under one name. So the identity hashes what the weights are, never where:

    weights_fingerprint(folder) = sha256 over sorted (file name, sha256 of its bytes)
                                  for every *.safetensors file of the folder

Cost: a full SHA-256 of each file, read in chunks, once per version of the file, cached in
memory and in `$XDG_CACHE_HOME/minivllm/weight_fingerprints/` (a version: real path, device,
inode, size, mtime and ctime; a write or a replacement changes ctime, which no one sets by
hand). A sampled hash would start faster once, but a fine-tune that changes only bytes it
skips would share blocks with its base model.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK_BYTES = 1 << 20
_WEIGHT_PATTERN = "*.safetensors"

_digests: dict[tuple, str] = {}  # a file's version -> its digest, for this process


def checkpoint_folder(model: str, revision: str | None = None) -> Path:
    """The folder the weights were loaded from: a local folder, or the hub cache's snapshot
    (already downloaded by the time a connector asks: the workers load the weights first)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download  # only for hub ids

    return Path(snapshot_download(model, revision=revision, local_files_only=True))


def weights_fingerprint(folder: str | os.PathLike) -> str:
    """SHA-256 (hex) of the folder's weight files' names and contents; ValueError if it has none."""
    files = sorted(Path(folder).glob(_WEIGHT_PATTERN))
    if not files:
        raise ValueError(f"no {_WEIGHT_PATTERN} file in {folder}: nothing to fingerprint the model by.")
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of one file's bytes, from the caches when this version was hashed before."""
    real = os.path.realpath(path)  # a hub snapshot links into its blob store
    st = os.stat(real)
    version = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if version in _digests:
        return _digests[version]
    cached = _cache_dir() / (hashlib.sha256(repr(version).encode()).hexdigest()[:32] + ".sha256")
    try:
        digest = cached.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 64:
        digest = _hash_file(real)
        _write_cache(cached, digest)
    _digests[version] = digest
    return digest


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minivllm" / "weight_fingerprints"


def _write_cache(path: Path, digest: str) -> None:
    """Best effort: a read-only home only costs hashing again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(digest)
        os.replace(temporary, path)  # atomic: two workers hashing at once agree anyway
    except OSError:
        pass
