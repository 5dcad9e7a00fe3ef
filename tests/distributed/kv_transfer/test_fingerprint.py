"""The model's fingerprint: its weights' bytes, never their path; hashed once per file version."""

from __future__ import annotations

import os
import shutil

import pytest

import kv_transfer_testing as kvt
from minivllm.distributed.kv_transfer import fingerprint
from minivllm.distributed.kv_transfer.fingerprint import weights_fingerprint


@pytest.fixture
def hashes(monkeypatch, tmp_path):
    """Each file hashed, in order; the disk cache in a fresh folder, the memory cache empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "_digests", {})
    hashed = []
    hash_file = fingerprint._hash_file
    monkeypatch.setattr(fingerprint, "_hash_file", lambda path: (hashed.append(path), hash_file(path))[1])
    return hashed


def test_the_same_bytes_anywhere_are_the_same_model(tmp_path, hashes):
    a = kvt.checkpoint_copy(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "elsewhere" / "b")
    assert weights_fingerprint(a) == weights_fingerprint(b)
    assert weights_fingerprint(a) != weights_fingerprint(kvt.checkpoint_copy(tmp_path / "c", seed=1))


def test_a_file_changed_in_place_is_hashed_again_even_with_its_size_and_mtime_kept(tmp_path, hashes):
    folder = kvt.checkpoint_copy(tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    before = weights_fingerprint(folder)
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: only ctime tells
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert weights_fingerprint(folder) != before
    assert len(hashes) == 2


def test_hashed_once_per_file_version_in_memory_and_on_disk(tmp_path, hashes, monkeypatch):
    folder = kvt.checkpoint_copy(tmp_path / "ckpt")
    first = weights_fingerprint(folder)
    assert weights_fingerprint(folder) == first and len(hashes) == 1  # memory
    monkeypatch.setattr(fingerprint, "_digests", {})  # another process: only the disk cache
    assert weights_fingerprint(folder) == first and len(hashes) == 1
    assert list((tmp_path / "cache" / "minivllm" / "weight_fingerprints").iterdir())


def test_a_folder_without_weights_has_no_fingerprint(tmp_path):
    with pytest.raises(ValueError, match="safetensors"):
        weights_fingerprint(tmp_path)
