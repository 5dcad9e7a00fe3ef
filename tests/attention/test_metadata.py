"""AttentionMetadata built from python lists: slots, offsets, and the prefill/decode views."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.attention import build_attn_metadata

BLOCK_SIZE = 4


def slot(block_table, position):
    """The brief's (and vLLM's) slot formula, written out once here as the reference."""
    return block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def test_slots_offsets_and_views_of_a_mixed_batch():
    tables = [[7, 2], [3], [5, 1, 6], [4]]
    context_lens, query_lens = [5, 0, 8, 2], [2, 3, 1, 1]  # two prefills, two decodes
    md = build_attn_metadata(tables, context_lens, query_lens, num_prefills=2, block_size=BLOCK_SIZE)
    expected_slots = [slot(t, p) for t, c, q in zip(tables, context_lens, query_lens)
                      for p in range(c, c + q)]
    assert md.slot_mapping.tolist() == expected_slots == [9, 10, 12, 13, 14, 24, 18]
    assert md.slot_mapping.dtype == torch.int64
    assert md.seq_lens.tolist() == [7, 3, 9, 3] and md.seq_lens.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 2, 5, 6, 7]
    assert md.block_tables.tolist() == [[7, 2, 0], [3, 0, 0], [5, 1, 6], [4, 0, 0]]
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 5, 2)
    assert (md.max_query_len, md.max_seq_len) == (3, 9)

    prefill, decode = md.prefill_metadata, md.decode_metadata
    assert prefill.seq_lens.tolist() == [7, 3] and prefill.query_start_loc.tolist() == [0, 2, 5]
    assert prefill.block_tables.shape == (2, 3) and prefill.slot_mapping.tolist() == expected_slots[:5]
    assert decode.seq_lens.tolist() == [9, 3] and decode.query_start_loc.tolist() == [0, 1, 2]
    assert decode.block_tables.tolist() == [[5, 1, 6], [4, 0, 0]]
    assert md.prefill_metadata is prefill  # built once per step, shared by every layer


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(0, 3)), max_size=8),
       st.integers(0, 8), st.randoms(use_true_random=False))
def test_every_new_token_gets_the_slot_of_its_position(seqs, num_prefills, rng):
    """Random batches (context, new tokens, spare blocks per sequence; decodes after the
    prefills have one new token): each token's slot is the formula's, in batch order."""
    num_prefills = min(num_prefills, len(seqs))
    context_lens = [c for c, _, _ in seqs]
    query_lens = [q if i < num_prefills else 1 for i, (_, q, _) in enumerate(seqs)]
    tables = [rng.sample(range(500), -(-(c + q) // BLOCK_SIZE) + spare)
              for c, q, (_, _, spare) in zip(context_lens, query_lens, seqs)]
    md = build_attn_metadata(tables, context_lens, query_lens, num_prefills, block_size=BLOCK_SIZE)
    assert md.slot_mapping.tolist() == [slot(t, p) for t, c, q in zip(tables, context_lens, query_lens)
                                        for p in range(c, c + q)]


def test_views_are_none_for_an_all_prefill_or_all_decode_batch():
    only_prefill = build_attn_metadata([[0]], [0], [3], num_prefills=1, block_size=BLOCK_SIZE)
    only_decode = build_attn_metadata([[0]], [3], [1], num_prefills=0, block_size=BLOCK_SIZE)
    assert only_prefill.decode_metadata is None and only_prefill.prefill_metadata is only_prefill
    # An all-decode batch is its own decode view: no new tensors, so a captured CUDA graph
    # keeps reading the static buffers it was captured with.
    assert only_decode.prefill_metadata is None and only_decode.decode_metadata is only_decode


def test_invalid_layouts_are_errors():
    with pytest.raises(ValueError, match="1 new token"):
        build_attn_metadata([[0], [1]], [0, 3], [2, 2], num_prefills=1, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        build_attn_metadata([[0]], [3], [2], num_prefills=1, block_size=BLOCK_SIZE)
    md = build_attn_metadata([[0]], [0], [3], num_prefills=1, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="slot_mapping"):
        type(md)(**{**md.__dict__, "slot_mapping": md.slot_mapping[:2]})


@given(st.lists(st.integers(0, 5000), max_size=6))
def test_each_packed_part_starts_16_byte_aligned_and_fits_its_bytes(nbytes):
    """Triton compiles a kernel again for a pointer off a 16-byte boundary: every part of the
    one-copy buffer starts on one, whatever the sizes before it."""
    from minivllm.attention.packed_copy import packed_starts

    starts = packed_starts(nbytes)
    assert all(start % 16 == 0 for start in starts)
    assert all(starts[i] + n <= starts[i + 1] < starts[i] + n + 16 for i, n in enumerate(nbytes))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_packed_copy_gives_each_tensor_its_values_dtype_and_shape():
    from minivllm.attention.packed_copy import to_device_together

    tensors = [torch.arange(5, dtype=torch.int64), torch.tensor([7, -1, 3], dtype=torch.int32),
               torch.zeros(0, 4, dtype=torch.int32), torch.arange(12, dtype=torch.int32).view(3, 4) - 6,
               torch.tensor([2**40 + 3])]
    for host, on_device in zip(tensors, to_device_together(tensors, "cuda")):
        assert on_device.device.type == "cuda" and on_device.dtype == host.dtype
        assert torch.equal(on_device.cpu(), host)
        assert on_device.data_ptr() % 16 == 0
    tables, context_lens, query_lens = [[7, 2], [3], [5, 1, 6]], [5, 0, 8], [2, 3, 1]
    md_cpu = build_attn_metadata(tables, context_lens, query_lens, num_prefills=2, block_size=BLOCK_SIZE)
    md_gpu = build_attn_metadata(tables, context_lens, query_lens, num_prefills=2, block_size=BLOCK_SIZE,
                                 device="cuda")
    for name in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
        assert torch.equal(getattr(md_gpu, name).cpu(), getattr(md_cpu, name)), name
