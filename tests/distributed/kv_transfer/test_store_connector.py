"""Block framing (any damage is detected) and the file store (atomic, LRU-bounded, never
reading or writing outside its folder)."""

from __future__ import annotations

import os
import shutil
import threading
import time
import tracemalloc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.distributed.kv_transfer.shared_storage_connector import FileKVStore
from minivllm.distributed.kv_transfer.store_connector import decode_block, encode_block, framed_bytes

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, heads, head_dim
KEY = "m/tp0of1/" + "ab" * 16


def _block(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_round_trip_in_every_cache_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        block = _block(dtype=dtype)
        assert torch.equal(decode_block(encode_block(block, KEY), KEY, SHAPE, dtype), block)


@settings(max_examples=60)
@given(st.data())
def test_any_truncation_or_flipped_byte_is_refused(data):
    encoded = encode_block(_block(), KEY)
    if data.draw(st.booleans()):
        damaged = encoded[:data.draw(st.integers(0, len(encoded) - 1))]
    else:
        i = data.draw(st.integers(0, len(encoded) - 1))
        damaged = encoded[:i] + bytes([encoded[i] ^ data.draw(st.integers(1, 255))]) + encoded[i + 1:]
    assert decode_block(damaged, KEY, SHAPE, torch.float32) is None


def test_a_block_of_another_shape_or_dtype_is_refused():
    encoded = encode_block(_block(), KEY)
    assert decode_block(encoded, KEY, (2, 2, 4, 2, 4), torch.float32) is None
    assert decode_block(encoded, KEY, SHAPE, torch.float16) is None
    assert decode_block(None, KEY, SHAPE, torch.float32) is None


def test_readers_never_see_half_a_file(tmp_path):
    """Writers race on the same keys while readers read them: every read is None or whole."""
    store = FileKVStore(tmp_path)
    payloads = {f"m/tp0of1/{k:032x}": encode_block(_block(k), f"m/tp0of1/{k:032x}") for k in range(4)}
    stop, bad = threading.Event(), []

    def write():
        try:
            while not stop.is_set():
                for key, data in payloads.items():
                    store.path(key).unlink(missing_ok=True)  # another engine's eviction
                    store.put_many([(key, data)])
        except Exception as error:  # a race the store must absorb
            bad.append(error)

    def read():
        while not stop.is_set():
            for key, data in payloads.items():
                got = store.get(key, len(data))
                if got is not None and got != data:
                    bad.append(key)

    threads = [threading.Thread(target=f) for f in (write, write, read, read)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not bad
    assert not list(tmp_path.rglob("*.tmp"))


def test_least_recently_used_files_go_first(tmp_path):
    store = FileKVStore(tmp_path)
    keys = [f"m/tp0of1/{k:032x}" for k in range(4)]
    for i, key in enumerate(keys):
        store.put_many([(key, encode_block(_block(i), key))])
        os.utime(store.path(key), (1000 + i, 1000 + i))  # written in order, one second apart
    store.get(keys[0], framed_bytes(SHAPE, torch.float32, keys[0]))  # read now: the most recently used
    size = store.path(keys[0]).stat().st_size
    assert store.evict(2 * size) == 2
    assert [store.exists([k]) for k in keys] == [True, False, False, True]


def _outside_block(tmp_path, key: str):
    """A whole, valid block file for `key`, outside any store."""
    target = tmp_path / "outside" / "block.kv"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(encode_block(_block(), key))
    return target


def test_a_block_name_that_is_a_link_is_never_read(tmp_path):
    store = FileKVStore(tmp_path / "store")
    key = "m/tp0of1/" + "cd" * 16
    store.path(key).parent.mkdir(parents=True)
    store.path(key).symlink_to(_outside_block(tmp_path, key))
    assert not store.exists([key])
    assert store.get(key, framed_bytes(SHAPE, torch.float32, key)) is None


def test_a_long_file_is_never_read_whole(tmp_path):
    """A sparse 1 GiB file at a block's name: refused after reading one block's bytes."""
    store = FileKVStore(tmp_path)
    key = "m/tp0of1/" + "ef" * 16
    store.path(key).parent.mkdir(parents=True)
    with open(store.path(key), "wb") as f:
        f.truncate(1 << 30)
    max_bytes = framed_bytes(SHAPE, torch.float32, key)
    tracemalloc.start()
    try:
        assert store.get(key, max_bytes) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a block and some bookkeeping, never the gigabyte


def test_a_fifo_at_a_block_name_is_not_waited_on(tmp_path):
    store = FileKVStore(tmp_path)
    key = "m/tp0of1/" + "01" * 16
    store.path(key).parent.mkdir(parents=True)
    os.mkfifo(store.path(key))
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get(key, 1024)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [None]


def test_a_folder_leading_outside_is_neither_written_nor_evicted_through(tmp_path, caplog):
    store = FileKVStore(tmp_path / "store")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.kv").write_bytes(b"not the store's")
    (tmp_path / "store" / "m").mkdir()
    (tmp_path / "store" / "m" / "tp0of1").symlink_to(outside, target_is_directory=True)
    keys = [f"m/tp0of1/{k:032x}" for k in range(3)]
    assert store.put_many([(key, encode_block(_block(), key)) for key in keys]) == 0  # none stored
    assert sorted(p.name for p in outside.rglob("*")) == ["precious.kv"]  # nothing written there
    assert "leads outside the store" in caplog.text
    assert store.evict(0) == 0 and (outside / "precious.kv").exists()
    digest = keys[0].rpartition("/")[2]
    (outside / digest[:2]).mkdir()
    shutil.copyfile(_outside_block(tmp_path, keys[0]), outside / digest[:2] / (digest + ".kv"))
    assert not store.exists([keys[0]])  # a valid block, but reached through the link: not read
    assert store.get(keys[0], framed_bytes(SHAPE, torch.float32, keys[0])) is None
