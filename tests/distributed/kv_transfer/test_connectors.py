"""Every connector against an engine with none: same greedy tokens, hits counted as cached
tokens, a restart reusing a store, a damaged or full store, two engines writing at once."""

from __future__ import annotations

import errno
import threading

import pytest

import kv_transfer_testing as kvt
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import register_connector
from minivllm.distributed.kv_transfer.shared_storage_connector import FileKVStore, SharedStorageConnector


def _files(path) -> list:
    return sorted(path.rglob("*.kv"))


def test_shared_storage_parity_and_restart(tmp_path, reference):
    """A first engine fills the store (no hits); a fresh engine (a restart) loads every full
    prompt block from it and still produces the same tokens."""
    config = kvt.shared_storage(tmp_path)
    first = kvt.run(kvt.make_engine(config))
    assert kvt.tokens(first) == reference
    assert all(cached == 0 for _, cached in first.values())
    assert _files(tmp_path)
    engine = kvt.make_engine(config)
    second = kvt.run(engine)
    assert kvt.tokens(second) == reference
    for rid, (_, cached) in second.items():
        assert cached == kvt.full_blocks_before_last_token(engine, kvt.PROMPTS[int(rid)]) > 0
    stats = engine.kv_transfer_stats
    assert stats.num_tokens_loaded == sum(cached for _, cached in second.values())
    assert stats.bytes_loaded > 0 and stats.num_load_errors == 0


@pytest.mark.parametrize("connector", ["SharedStorageConnector", "CPUOffloadConnector"])
def test_the_triton_backend_saves_and_loads_through_its_fused_attention_path(tmp_path, reference, connector):
    """On the "triton" backend a fused kernel writes the new keys and values, and the model
    calls the attention module with k = v = None; the connector's per-layer hooks sit on that
    module and must still run. (They once did not: nothing was saved, the restart loaded
    uninitialised host memory and decoded garbage, while every torch-backend test passed.)
    Triton's interpreter on a CPU."""
    extra = {"shared_storage_path": str(tmp_path)} if connector == "SharedStorageConnector" else {"num_cpu_blocks": 64}
    config = KVTransferConfig(connector, "kv_both", extra)
    first = kvt.make_engine(config, attention_backend="triton")
    assert kvt.tokens(kvt.run(first)) == reference
    assert first.kv_transfer_stats.num_tokens_saved > 0
    # A restart (files), or the same engine again (host memory): every full block loaded.
    engine = kvt.make_engine(config, attention_backend="triton") if connector == "SharedStorageConnector" else first
    again = kvt.run(engine)
    assert kvt.tokens(again) == reference
    assert all(cached > 0 for _, cached in again.values()) and engine.kv_transfer_stats.num_tokens_loaded > 0


def test_shared_prefix_hits_within_one_engine_after_prefix_cache_eviction(tmp_path, reference):
    """Requests run one after another: the second prompt's shared prefix comes from the store."""
    engine = kvt.make_engine(kvt.shared_storage(tmp_path))
    results = {}
    for i, prompt in enumerate(kvt.PROMPTS[:2]):
        results.update({str(i): out for out in kvt.run(engine, [prompt]).values()})
    assert kvt.tokens(results) == {rid: reference[rid] for rid in ("0", "1")}
    first, second = (engine.tokenizer.encode(p) for p in kvt.PROMPTS[:2])
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert results["1"][1] == common // kvt.BLOCK_SIZE * kvt.BLOCK_SIZE > 0  # "ROMEO: But soft, ..."


def test_cpu_offload_parity_and_hits(reference):
    engine = kvt.make_engine(KVTransferConfig("CPUOffloadConnector", "kv_both", {"num_cpu_blocks": 64}))
    assert kvt.tokens(kvt.run(engine)) == reference
    again = kvt.run(engine)  # the host pool now holds every prompt block
    assert kvt.tokens(again) == reference
    for rid, (_, cached) in again.items():
        assert cached == kvt.full_blocks_before_last_token(engine, kvt.PROMPTS[int(rid)])


def test_cpu_offload_pool_smaller_than_the_work(reference):
    """A pool of 3 blocks: LRU eviction, partial hits, the same tokens."""
    engine = kvt.make_engine(KVTransferConfig("CPUOffloadConnector", "kv_both", {"num_cpu_blocks": 3}))
    assert kvt.tokens(kvt.run(engine)) == reference
    again = kvt.run(engine)
    assert kvt.tokens(again) == reference
    assert len(engine.kv_connector.index) == 3  # the scheduler side's LRU index: full, never over
    assert all(cached <= 3 * kvt.BLOCK_SIZE for _, cached in again.values())


def test_redis_parity_and_restart(redis_server, reference):
    config = KVTransferConfig("RedisConnector", "kv_both", {"url": redis_server.url})
    assert kvt.tokens(kvt.run(kvt.make_engine(config))) == reference
    engine = kvt.make_engine(config)
    second = kvt.run(engine)
    assert kvt.tokens(second) == reference
    assert all(cached > 0 for _, cached in second.values())


def test_redis_dies_mid_run(redis_server, reference, caplog):
    """The store goes away between steps: lookups and saves fail, requests recompute, none
    fails, tokens unchanged."""
    config = KVTransferConfig("RedisConnector", "kv_both", {"url": redis_server.url, "timeout_s": 0.5})
    kvt.run(kvt.make_engine(config), kvt.PROMPTS[:2])  # the store holds the first two prompts
    engine = kvt.make_engine(config)
    params = kvt.SamplingParams(temperature=0.0, max_tokens=kvt.MAX_TOKENS)
    engine.add_request("0", kvt.PROMPTS[0], params)
    engine.step()  # loads request 0 from Redis
    redis_server.kill()
    for rid in ("1", "2", "3"):  # 1 is in the dead store, 2 and 3 would be saved to it
        engine.add_request(rid, kvt.PROMPTS[int(rid)], params)
    results, cached = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].finish_reason != "abort"
                results[output.request_id] = list(output.outputs[0].token_ids)
                cached[output.request_id] = output.num_cached_tokens
    assert results == reference
    assert cached["0"] > 0 and cached["1"] == 0  # loaded before the outage; recomputed after it
    assert "KV store unavailable" in caplog.text
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    # A fresh engine pointed at the dead server starts and serves too.
    assert kvt.tokens(kvt.run(kvt.make_engine(config))) == reference


def test_damaged_and_truncated_files_are_recomputed(tmp_path, reference, caplog):
    config = kvt.shared_storage(tmp_path)
    kvt.run(kvt.make_engine(config))
    files = _files(tmp_path)
    assert len(files) >= 6
    files[0].write_bytes(files[0].read_bytes()[:100])             # truncated
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF                                               # one flipped byte
    files[1].write_bytes(bytes(data))
    files[2].write_bytes(b"")                                      # empty
    files[3].write_bytes(b"not a block at all" * 10)               # garbage
    engine = kvt.make_engine(config)
    assert kvt.tokens(kvt.run(engine)) == reference
    assert engine.kv_transfer_stats.num_load_errors >= 4
    assert "missing or damaged" in caplog.text


class VanishingStore(FileKVStore):
    """Every file disappears between the scheduler's lookup and the worker's read: another
    engine's eviction, at the worst moment."""

    def get(self, key, max_bytes):
        self.path(key).unlink(missing_ok=True)
        return super().get(key, max_bytes)


class VanishingStorageConnector(SharedStorageConnector):
    def make_store(self):
        return VanishingStore(self.extra_config["shared_storage_path"])


def test_file_evicted_between_lookup_and_load_through_a_registered_connector(tmp_path, reference):
    """Also the factory: a connector from outside minivllm, registered by name."""
    register_connector("VanishingStorageConnector", __name__, "VanishingStorageConnector")
    kvt.run(kvt.make_engine(kvt.shared_storage(tmp_path)))
    config = KVTransferConfig("VanishingStorageConnector", "kv_consumer", {"shared_storage_path": str(tmp_path)})
    engine = kvt.make_engine(config)
    results = kvt.run(engine)
    assert kvt.tokens(results) == reference
    assert all(cached > 0 for _, cached in results.values())  # counted as hits, then recomputed
    assert engine.kv_transfer_stats.num_load_errors > 0 and engine.kv_transfer_stats.num_tokens_loaded == 0


def test_full_store_evicts_least_recently_used(tmp_path, reference):
    """A store of 3 blocks' worth of bytes never holds more; hits are partial, tokens equal."""
    kvt.run(kvt.make_engine(kvt.shared_storage(tmp_path / "probe")))
    block_bytes = _files(tmp_path / "probe")[0].stat().st_size
    config = kvt.shared_storage(tmp_path / "small", max_size_gb=3 * block_bytes / 2**30)
    assert kvt.tokens(kvt.run(kvt.make_engine(config))) == reference
    assert sum(f.stat().st_size for f in _files(tmp_path / "small")) <= 3 * block_bytes
    assert kvt.tokens(kvt.run(kvt.make_engine(config))) == reference
    empty = kvt.shared_storage(tmp_path / "zero", max_size_gb=0)
    assert kvt.tokens(kvt.run(kvt.make_engine(empty))) == reference
    assert not _files(tmp_path / "zero")


def test_two_engines_write_one_store_at_once(tmp_path, reference):
    """Two engines in two threads write the same blocks into one folder; a third reads them all
    back intact (atomic renames: no half-written file is ever visible)."""
    config = kvt.shared_storage(tmp_path)
    engines = [kvt.make_engine(config) for _ in range(2)]
    results: list = [None, None]

    def work(i):
        results[i] = kvt.tokens(kvt.run(engines[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [reference, reference]
    assert not list(tmp_path.rglob("*.tmp"))
    reader = kvt.make_engine(config)
    assert kvt.tokens(kvt.run(reader)) == reference
    assert reader.kv_transfer_stats.num_load_errors == 0 and reader.kv_transfer_stats.num_tokens_loaded > 0


@pytest.mark.parametrize("connector", ["SharedStorageConnector", "CPUOffloadConnector"])
def test_chunked_prefill_and_prefix_caching_with_a_connector(tmp_path, reference, connector):
    """Saves that span several prompt chunks, loads after local prefix-cache hits."""
    extra = {"shared_storage_path": str(tmp_path)} if connector == "SharedStorageConnector" else {}
    config = KVTransferConfig(connector, "kv_both", extra)
    engine = kvt.make_engine(config, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4,
                             enable_prefix_caching=True)
    assert kvt.tokens(kvt.run(engine)) == reference
    assert kvt.tokens(kvt.run(engine)) == reference


def test_aborted_requests_return_their_blocks(tmp_path):
    engine = kvt.make_engine(kvt.shared_storage(tmp_path))
    for i, prompt in enumerate(kvt.PROMPTS):
        engine.add_request(str(i), prompt, kvt.SamplingParams(temperature=0.0, max_tokens=kvt.MAX_TOKENS))
    engine.step()
    engine.abort_request([str(i) for i in range(len(kvt.PROMPTS))])
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_tensor_parallel_ranks_keep_their_own_shards(tmp_path, reference):
    """Two ranks (processes, gloo): each saves and loads its own shard of every block. When only
    rank 1's files are damaged, both ranks recompute together (the extra forward is a
    collective) and the tokens stay those of one process."""
    engine = kvt.make_engine(kvt.shared_storage(tmp_path), tensor_parallel_size=2)
    try:
        assert kvt.tokens(kvt.run(engine)) == reference
        shards = {path.parent.parent.name for path in _files(tmp_path)}
        assert shards == {"tp0of2", "tp1of2"}
        for path in _files(tmp_path):
            if path.parent.parent.name == "tp1of2":
                path.write_bytes(path.read_bytes()[:-1])
        again = kvt.run(engine)
        assert kvt.tokens(again) == reference
        assert all(cached > 0 for _, cached in again.values())
    finally:
        engine.shutdown()


def test_cpu_offload_index_takes_a_block_only_after_its_step():
    """Slots written in a step join the index at the next schedule(); a request aborted before
    that (its step may have failed) gives its slots back unindexed."""
    engine = kvt.make_engine(KVTransferConfig("CPUOffloadConnector", "kv_both", {"num_cpu_blocks": 8}))
    connector = engine.kv_connector
    engine.add_request("a", kvt.PROMPTS[0], kvt.SamplingParams(temperature=0.0, max_tokens=4))
    _, outputs, _ = engine.scheduler.schedule()  # what a step would run: saves planned, not done
    planned = sum(len(r.save) for r in outputs.kv_connector_metadata.requests)
    assert planned > 0 and not connector.index and len(connector.free_slots) == 8 - planned
    engine.abort_request("a")
    assert not connector.index and len(connector.free_slots) == 8
    engine.add_request("b", kvt.PROMPTS[0], kvt.SamplingParams(temperature=0.0, max_tokens=4))
    kvt.run(engine, [])  # b runs whole steps: its saves are confirmed
    assert len(connector.index) == planned


def test_failed_writes_are_not_counted_as_saved(tmp_path, reference, caplog, monkeypatch):
    def disk_full(self, path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileKVStore, "_put", disk_full)
    engine = kvt.make_engine(kvt.shared_storage(tmp_path))
    assert kvt.tokens(kvt.run(engine)) == reference
    assert engine.kv_transfer_stats.num_tokens_saved == engine.kv_transfer_stats.bytes_saved == 0
    assert "KV store unavailable" in caplog.text and not _files(tmp_path)


def test_a_shard_folder_leading_outside_the_store_is_not_written_through(tmp_path, reference, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    engine = kvt.make_engine(kvt.shared_storage(tmp_path / "store"))
    (tmp_path / "store" / engine.kv_connector.root).mkdir()
    (tmp_path / "store" / engine.kv_connector.root / "tp0of1").symlink_to(outside, target_is_directory=True)
    assert kvt.tokens(kvt.run(engine)) == reference
    assert not list(outside.rglob("*"))
    assert engine.kv_transfer_stats.num_tokens_saved == 0
    assert "leads outside the store" in caplog.text
