"""Labs 04 and 05's checks (`minivllm/labs/attention.py`): the package's own ops pass them, and
ops with the mistakes a learner makes fail them, naming the case (and the mistake, where the
output gives it away)."""

from __future__ import annotations

import types

import pytest
import torch

from minivllm.kernels import OP_NAMES, reference, register_backend
from minivllm.labs import LabCheckFailed
from minivllm.labs import attention as lab

# --------------------------------------------------------------------------- the package passes


def test_the_reference_ops_pass():
    lab.check_gather_kv(reference.gather_kv)
    lab.check_attention(reference._attention)
    lab.check_paged_prefill(reference.paged_prefill_attention)
    lab.check_paged_decode(reference.paged_attention_decode)


def test_the_triton_decode_kernel_passes():
    """The package's kernel (v1 and split-KV v2; Triton's interpreter on a CPU)."""
    from minivllm.kernels.paged_attention import paged_attention_decode

    lab.check_paged_decode(paged_attention_decode)
    lab.check_paged_decode(lambda *args: paged_attention_decode(*args, num_kv_splits=2))


def test_the_cases_are_what_their_names_say():
    for case in lab.DECODE_CASES + lab.PREFILL_CASES:
        batch = lab.build_batch(case)
        used = [b for table in batch.tables for b in table]
        assert len(set(used)) == len(used)  # every block has one owner
        assert len(used) < 3 or used != sorted(used)  # shuffled: a block table is not a range
        assert batch.key_cache.isnan().any()  # unowned slots exist, and hold NaN
    assert any(n % case.block_size for case in lab.DECODE_CASES for n in case.seq_lens)  # partial last blocks
    assert any(case.num_heads > case.num_kv_heads for case in lab.DECODE_CASES + lab.PREFILL_CASES)  # GQA
    assert any(q < n for case in lab.PREFILL_CASES for n, q in zip(case.seq_lens, case.query_lens))  # context


# --------------------------------------------------------------------------- wrong ops fail
def _no_scale_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_kv_splits=None):
    return reference.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, 1.0)


def _no_scale_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                      max_query_len=None):
    return reference.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                             seq_lens, 1.0)


def _logical_block_gather(key_cache, value_cache, block_table, seq_len):
    """Reads logical block i from physical block i: the block table ignored."""
    num_blocks = -(-seq_len // key_cache.shape[1])
    return key_cache[:num_blocks].flatten(0, 1)[:seq_len], value_cache[:num_blocks].flatten(0, 1)[:seq_len]


def _off_by_one_block_gather(key_cache, value_cache, block_table, seq_len):
    """Indexes the block table with t // block_size + 1."""
    block_size = key_cache.shape[1]
    t = torch.arange(seq_len)
    blocks = block_table[(t // block_size + 1).clamp(max=len(block_table) - 1)].long()
    return key_cache[blocks, t % block_size], value_cache[blocks, t % block_size]


def _whole_blocks_gather(key_cache, value_cache, block_table, seq_len):
    """Returns every slot of the sequence's blocks: the last block's fill ignored."""
    blocks = block_table[: -(-seq_len // key_cache.shape[1])].long()
    return key_cache[blocks].flatten(0, 1), value_cache[blocks].flatten(0, 1)


def _whole_blocks_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_kv_splits=None):
    """Attends over every slot of the sequence's blocks, as if the last block were full."""
    block_size = key_cache.shape[1]
    padded = (seq_lens + block_size - 1) // block_size * block_size
    return reference.paged_attention_decode(query, key_cache, value_cache, block_tables, padded, scale)


def _no_causal_mask(query, keys, values, scale, num_context):
    return reference._attention(query, keys, values, scale, num_context=len(keys))


def _no_causal_mask_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                            max_query_len=None):
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        keys, values = reference.gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        out[starts[i]:starts[i + 1]] = _no_causal_mask(query[starts[i]:starts[i + 1]], keys, values, scale, 0)
    return out


def _mask_without_context(query, keys, values, scale, num_context):
    return reference._attention(query, keys, values, scale, num_context=0)


def _modulo_kv_head(query, keys, values, scale, num_context):
    kv_head = torch.arange(query.shape[1]) % keys.shape[1]
    return reference._attention(query, keys[:, kv_head], values[:, kv_head], scale, num_context)


def _masked_scores_only_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_kv_splits=None):
    """Batched decode that masks the scores but multiplies the values of empty slots by 0."""
    keys = key_cache[block_tables.long()].flatten(1, 2)
    values = value_cache[block_tables.long()].flatten(1, 2)
    group = query.shape[1] // keys.shape[2]
    keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
    valid = torch.arange(keys.shape[1])[None, :] < seq_lens[:, None]
    scores = torch.einsum("shd,sthd->sht", query, keys) * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("sht,sthd->shd", probs, values)


@pytest.mark.parametrize("check, op, message", [
    (lab.check_paged_decode, _no_scale_decode, "scale is missing"),
    (lab.check_paged_prefill, _no_scale_prefill, "scale is missing"),
    (lab.check_gather_kv, _logical_block_gather, "physical block"),
    (lab.check_gather_kv, _off_by_one_block_gather, "physical block"),
    (lab.check_gather_kv, _whole_blocks_gather, "expected"),
    (lab.check_paged_decode, _whole_blocks_decode, "NaN"),
    (lab.check_paged_decode, _masked_scores_only_decode, "NaN"),
    (lab.check_attention, _no_causal_mask, "no causal mask"),
    (lab.check_paged_prefill, _no_causal_mask_prefill, "no causal mask"),
    (lab.check_attention, _mask_without_context, "ignores the cached context"),
    (lab.check_attention, _modulo_kv_head, "h % num_kv_heads"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_a_wrong_op_fails_with_the_reason(check, op, message):
    with pytest.raises(LabCheckFailed, match="case '") as failure:
        check(op)
    assert message in str(failure.value)


def test_a_skeleton_is_not_written_yet():
    def skeleton(*args, **kwargs):
        raise NotImplementedError("write `paged_attention_decode`")

    with pytest.raises(NotImplementedError):
        lab.check_paged_decode(skeleton)


# --------------------------------------------------------------------------- inside the engine
def _backend(name: str, **ops) -> types.ModuleType:
    module = types.ModuleType(name)
    for op in OP_NAMES:
        setattr(module, op, ops.get(op, getattr(reference, op)))
    register_backend(name, module)
    return module


def test_the_engine_check_runs_chunks_over_context_and_mixed_steps():
    """ENGINE_SETTINGS must put the learner's prefill over a cached context and share steps
    between a prompt's chunk and the other's decodes; the reference ops pass."""
    seen = {"context": 0, "decode_tokens": 0}

    def prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len=None):
        new = query_start_loc[1:] - query_start_loc[:-1]
        seen["context"] = max(seen["context"], int((seq_lens - new).max()))
        return reference.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                                 seq_lens, scale)

    def decode(query, *args, **kwargs):
        seen["decode_tokens"] += len(query)
        return reference.paged_attention_decode(query, *args, **kwargs)

    _backend("lab-test-reference", paged_prefill_attention=prefill, paged_attention_decode=decode)
    tokens = lab.check_attention_backend("lab-test-reference", max_tokens=4)
    assert len(tokens) == 2 and all(len(t) == 4 for t in tokens)
    assert seen["context"] > 0 and seen["decode_tokens"] > 0


def test_the_engine_check_fails_on_a_wrong_decode():
    _backend("lab-test-no-scale", paged_attention_decode=_no_scale_decode)
    with pytest.raises(LabCheckFailed, match="transformers says"):
        lab.check_attention_backend("lab-test-no-scale", max_tokens=4)


def test_the_engine_check_names_a_backend_that_is_not_registered():
    with pytest.raises(LabCheckFailed, match="unknown kernel backend"):
        lab.check_attention_backend("lab-test-never-registered")
