"""A store never serves a block to a model that did not compute it: another checkpoint under the
same path, a checkpoint replaced in place, swapped block files, a store of another dtype. Each
is a miss (counted, logged) and the tokens are those of an engine with no store."""

from __future__ import annotations

import os
import shutil

import kv_transfer_testing as kvt
from minivllm.distributed.kv_transfer.keys import block_digests


def _files(path) -> list:
    return sorted(path.rglob("*.kv"))


def test_two_checkpoints_at_the_same_relative_path_share_no_blocks(tmp_path, monkeypatch):
    store = kvt.shared_storage(tmp_path / "store")
    kvt.checkpoint_copy(tmp_path / "a" / "ckpt")
    kvt.checkpoint_copy(tmp_path / "b" / "ckpt", seed=1)
    monkeypatch.chdir(tmp_path / "b")
    expected = kvt.tokens(kvt.run(kvt.make_engine(model="ckpt")))
    monkeypatch.chdir(tmp_path / "a")
    kvt.run(kvt.make_engine(store, model="ckpt"))  # fills the store with a's blocks
    assert _files(tmp_path / "store")
    monkeypatch.chdir(tmp_path / "b")
    engine = kvt.make_engine(store, model="ckpt")
    results = kvt.run(engine)
    assert kvt.tokens(results) == expected
    assert all(cached == 0 for _, cached in results.values())  # nothing of a's is b's
    assert engine.kv_transfer_stats.num_tokens_loaded == 0


def test_a_checkpoint_replaced_in_place_is_another_model(tmp_path):
    store = kvt.shared_storage(tmp_path / "store")
    folder = kvt.checkpoint_copy(tmp_path / "ckpt")
    kvt.run(kvt.make_engine(store, model=str(folder)))
    kvt.checkpoint_copy(tmp_path / "new", seed=2)
    os.replace(tmp_path / "new" / "model.safetensors", folder / "model.safetensors")  # same path, new weights
    expected = kvt.tokens(kvt.run(kvt.make_engine(model=str(folder))))
    engine = kvt.make_engine(store, model=str(folder))
    results = kvt.run(engine)
    assert kvt.tokens(results) == expected
    assert engine.kv_transfer_stats.num_tokens_loaded == 0
    # And the store still serves the weights that wrote it, once they are back.
    kvt.checkpoint_copy(folder)
    again = kvt.make_engine(store, model=str(folder))
    assert kvt.tokens(kvt.run(again)) == kvt.tokens(kvt.run(kvt.make_engine(model=str(folder))))
    assert again.kv_transfer_stats.num_tokens_loaded > 0 and again.kv_transfer_stats.num_load_errors == 0


def test_swapped_block_files_are_refused(tmp_path, reference, caplog):
    """Every file of the store gets the bytes of the next one (each intact, each under the
    wrong name): every load is refused by the key in the block's own header."""
    config = kvt.shared_storage(tmp_path)
    kvt.run(kvt.make_engine(config))
    files = _files(tmp_path)
    contents = [f.read_bytes() for f in files]
    for f, data in zip(files, contents[1:] + contents[:1]):
        f.write_bytes(data)
    engine = kvt.make_engine(config)
    assert kvt.tokens(kvt.run(engine)) == reference
    stats = engine.kv_transfer_stats
    assert stats.num_key_mismatches == stats.num_load_errors > 0 and stats.num_tokens_loaded == 0
    assert "hold another key" in caplog.text


def test_blocks_of_another_dtype_under_this_engine_s_names_are_refused(tmp_path):
    """A float16 engine's blocks, each copied to the name a bfloat16 engine looks up for the
    same tokens (the two dtypes' blocks have the same size: only the key in the header tells
    them apart)."""
    config = kvt.shared_storage(tmp_path)
    writer = kvt.make_engine(config, dtype="float16")
    kvt.run(writer)
    reader = kvt.make_engine(config, dtype="bfloat16")
    store = reader.kv_connector.store
    for prompt in kvt.PROMPTS:
        token_ids = reader.tokenizer.encode(prompt)
        theirs = block_digests(token_ids, kvt.BLOCK_SIZE, writer.kv_connector.root)
        ours = block_digests(token_ids, kvt.BLOCK_SIZE, reader.kv_connector.root)
        for a, b in zip(theirs, ours):
            target = store.path(f"{reader.kv_connector.root}/tp0of1/{b}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(store.path(f"{writer.kv_connector.root}/tp0of1/{a}"), target)
    expected = kvt.tokens(kvt.run(kvt.make_engine(dtype="bfloat16")))
    results = kvt.run(reader)
    assert kvt.tokens(results) == expected
    stats = reader.kv_transfer_stats
    assert stats.num_key_mismatches == stats.num_load_errors > 0 and stats.num_tokens_loaded == 0
    assert all(cached > 0 for _, cached in results.values())  # looked up as hits, then refused


def test_the_model_is_fingerprinted_once_per_engine_not_per_rank(tmp_path, reference, monkeypatch):
    """The scheduler side hashes the weights; the workers read the identity from the block refs
    it sends them (so tensor-parallel ranks cannot disagree with it, and never read the weights)."""
    from minivllm.distributed.kv_transfer import store_connector

    calls = []
    identity = store_connector.model_identity
    monkeypatch.setattr(store_connector, "model_identity", lambda config: (calls.append(1), identity(config))[1])
    engine = kvt.make_engine(kvt.shared_storage(tmp_path))
    assert kvt.tokens(kvt.run(engine)) == reference
    again = kvt.make_engine(kvt.shared_storage(tmp_path))
    assert kvt.tokens(kvt.run(again)) == reference and again.kv_transfer_stats.num_tokens_loaded > 0
    assert len(calls) == 2  # one per engine
