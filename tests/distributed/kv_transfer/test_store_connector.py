"""Block framing (any damage is detected) and the file store (atomic, LRU-bounded)."""

from __future__ import annotations

import os
import threading
import time

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
