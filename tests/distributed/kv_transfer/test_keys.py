"""The store keys: the prefix cache's hash chain, stable across processes, one per shard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

import kv_transfer_testing as kvt
from minivllm.core.block_manager import hash_block_tokens
from minivllm.distributed.kv_transfer.keys import block_digests, model_identity, shard_name

tokens = st.lists(st.integers(0, 50_000), max_size=40)


@given(tokens, tokens, st.sampled_from([1, 2, 4, 8]))
def test_digests_agree_exactly_on_the_shared_full_blocks(a, b, block_size):
    """Block i has the same key in two sequences iff their first (i+1) blocks are equal: the
    property of the block manager's chain, which the keys reproduce."""
    da, db = block_digests(a, block_size, "m"), block_digests(b, block_size, "m")
    for i in range(min(len(da), len(db))):
        same_prefix = a[:(i + 1) * block_size] == b[:(i + 1) * block_size]
        assert (da[i] == db[i]) == same_prefix
        chain_a = chain_b = None
        for j in range(i + 1):
            chain_a = hash_block_tokens(chain_a, tuple(a[j * block_size:(j + 1) * block_size]))
            chain_b = hash_block_tokens(chain_b, tuple(b[j * block_size:(j + 1) * block_size]))
        assert (chain_a == chain_b) == (da[i] == db[i])


@given(tokens, st.sampled_from([1, 4, 16]))
def test_never_the_block_of_the_last_token(token_ids, block_size):
    assert len(block_digests(token_ids, block_size, "m")) == max(0, (len(token_ids) - 1) // block_size)


def test_the_root_separates_models():
    assert block_digests([1, 2, 3], 2, "model-a") != block_digests([1, 2, 3], 2, "model-b")


def test_digests_are_the_same_in_another_process():
    import minivllm.distributed.kv_transfer.keys as keys  # loaded by path below: no torch, fast

    code = ("import importlib.util as u; s = u.spec_from_file_location('k', %r); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.block_digests(list(range(33)), 8, 'root'))" % keys.__file__)
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(block_digests(list(range(33)), 8, "root"))


def test_model_identity_depends_on_what_changes_the_bytes():
    base = kvt.make_engine().engine_config
    same = kvt.make_engine().engine_config
    other_block = kvt.make_engine(block_size=16).engine_config
    other_dtype = kvt.make_engine(dtype="bfloat16").engine_config
    assert model_identity(base) == model_identity(same)
    assert len({model_identity(base), model_identity(other_block), model_identity(other_dtype)}) == 3


def test_each_tensor_parallel_rank_has_its_own_shard_key():
    names = [shard_name(rank, 4) for rank in range(4)]
    assert len(set(names)) == 4 and shard_name(0, 1) != shard_name(0, 2)


def test_a_lora_adapter_has_its_own_chain():
    from minivllm.distributed.kv_transfer.keys import request_root
    from minivllm.lora.request import LoRARequest

    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 1, "/adapters/b")
    roots = {request_root("m", None), request_root("m", a), request_root("m", b)}
    assert len(roots) == 3 and request_root("m", None) == "m"
    assert request_root("m", a) == request_root("m", LoRARequest("a", 7, "/adapters/a"))  # the id is engine-local


def _identity(model: str, **kwargs) -> str:
    from minivllm.engine.arg_utils import EngineArgs

    return model_identity(EngineArgs(model=model, device="cpu", block_size=kvt.BLOCK_SIZE, **kwargs)
                          .create_engine_config())


def test_model_identity_is_the_weights_not_the_path(tmp_path, monkeypatch):
    """Two checkpoints reached by one relative path are two models; one copied elsewhere is one."""
    kvt.checkpoint_copy(tmp_path / "a" / "ckpt")
    kvt.checkpoint_copy(tmp_path / "b" / "ckpt", seed=1)
    shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "copy")
    monkeypatch.chdir(tmp_path / "a")
    a = _identity("ckpt")
    monkeypatch.chdir(tmp_path / "b")
    assert _identity("ckpt") != a
    assert _identity(str(tmp_path / "copy")) == a


def test_model_identity_covers_the_config_and_the_parallel_layout(tmp_path):
    folder = kvt.checkpoint_copy(tmp_path / "ckpt")
    base = _identity(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # same weights, another computation
    (folder / "config.json").write_text(json.dumps(config))
    assert _identity(str(folder)) != base
    # The rank's shard is in the key's shard name; the layout's sizes are in the identity.
    assert _identity(str(folder)) != _identity(str(folder), tensor_parallel_size=2)
