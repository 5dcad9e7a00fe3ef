"""The Triton decode kernel (v1 and v2 split-KV) against the PyTorch reference.

On CPU this runs in Triton's interpreter (fp32, fp16); on the GPU machine also in bf16 and at
real sizes (`-m gpu`). The reference itself is checked against dense SDPA in test_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import paged_attention, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [  # the interpreter's bf16 dot is wrong: bf16 on the GPU only
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]
# Hand-picked, not a cartesian product (the interpreter is slow): every GQA group size, head
# dim and block size appears, each with v1, v2 and the automatic choice somewhere.
CASES = [  # num_heads, num_kv_heads, head_dim, block_size, num_kv_splits
    pytest.param(2, 2, 64, 16, 1, id="group1-d64-bs16-v1"),
    pytest.param(4, 2, 128, 16, 3, id="group2-d128-bs16-v2x3"),
    pytest.param(8, 2, 32, 8, 1, id="group4-d32-bs8-v1"),
    pytest.param(8, 1, 64, 32, 4, id="group8-d64-bs32-v2x4"),
    pytest.param(6, 2, 64, 16, None, id="group3-d64-bs16-auto"),
]


def _decode_inputs(paged_cache, num_heads, num_kv_heads, head_dim, block_size, dtype, seq_lens):
    cache = paged_cache(48, block_size, num_kv_heads, head_dim, dtype)
    tables = cache.block_tables(seq_lens)
    query = cache.randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    return cache, query, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,num_kv_splits", CASES)
def test_decode_matches_reference(paged_cache, check_close, dtype, num_heads, num_kv_heads,
                                  head_dim, block_size, num_kv_splits):
    # Ragged: a single token, exact multiples of the block size, a partial last block.
    seq_lens = [1, block_size, 2 * block_size + 3, 3 * block_size]
    cache, query, tables, lens = _decode_inputs(paged_cache, num_heads, num_kv_heads, head_dim,
                                                block_size, dtype, seq_lens)
    scale = head_dim**-0.5
    out = paged_attention.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables,
                                                 lens, scale, num_kv_splits=num_kv_splits)
    expected = reference.paged_attention_decode(query.float(), cache.key_cache.float(),
                                                cache.value_cache.float(), tables, lens, scale)
    assert out.dtype == dtype
    check_close(out, expected, dtype)


def test_decode_reads_a_strided_query(paged_cache, check_close):
    """The model hands over q as a view of its fused qkv projection: strides, not contiguity."""
    cache, _, tables, lens = _decode_inputs(paged_cache, 4, 2, 32, 8, torch.float32, [5, 9])
    qkv = cache.randn(2, 4 + 2 + 2, 32, dtype=torch.float32)
    query = qkv[:, :4]  # [num_seqs, num_heads, head_dim], not contiguous
    out = paged_attention.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables, lens, 0.2)
    check_close(out, reference.paged_attention_decode(query, cache.key_cache, cache.value_cache,
                                                      tables, lens, 0.2), torch.float32)


def test_split_kv_merges_in_the_kernel_and_leaves_its_counters_at_zero(paged_cache, check_close):
    """v2 has no reduce kernel: the last split of each (sequence, KV head) merges the partials,
    counted by an atomic counter that it resets. Run twice on the same workspace (what a
    replayed CUDA graph does, and what every layer of a step does): same answer, counters 0.
    More splits than some sequences fill (1 token, 9 tokens): they merge fewer partials."""
    seq_lens = [1, 9, 70, 130]
    cache, query, tables, lens = _decode_inputs(paged_cache, 4, 2, 32, 8, torch.float32, seq_lens)
    expected = reference.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables, lens, 0.3)
    counters = paged_attention.split_counters(query.device, len(seq_lens) * 2)
    outs = [paged_attention.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables, lens,
                                                   0.3, num_kv_splits=5) for _ in range(2)]
    for out in outs:
        check_close(out, expected, torch.float32)
    assert torch.equal(outs[0], outs[1])
    assert int(counters.count_nonzero()) == 0
    assert counters is paged_attention.split_counters(query.device, 1)  # one workspace, reused


def test_choose_num_kv_splits_fills_the_gpu_only_when_needed():
    choose = paged_attention.choose_num_kv_splits
    # Large batch: num_seqs * num_kv_heads programs already cover every SM several times.
    assert choose(num_seqs=64, num_kv_heads=8, max_context_len=4096, num_sms=132) == 1
    assert choose(num_seqs=256, num_kv_heads=8, max_context_len=1024, num_sms=132) == 1
    # Few, long sequences: split until the grid covers the SMs several times over.
    splits = choose(num_seqs=8, num_kv_heads=8, max_context_len=32768, num_sms=132)
    assert splits > 1 and 8 * 8 * splits >= paged_attention.TARGET_PROGRAMS_PER_SM * 132
    # ... but never into splits shorter than MIN_TOKENS_PER_SPLIT, nor more than MAX_KV_SPLITS.
    assert choose(num_seqs=1, num_kv_heads=8, max_context_len=128, num_sms=132) == 2
    assert choose(num_seqs=1, num_kv_heads=1, max_context_len=1 << 20, num_sms=132) == paged_attention.MAX_KV_SPLITS


def test_decode_rejects_bad_arguments(paged_cache):
    cache, query, tables, lens = _decode_inputs(paged_cache, 4, 2, 32, 8, torch.float32, [3])
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_attention.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables, lens, 1.0,
                                               num_kv_splits=0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention.paged_attention_decode(query[:, :3], cache.key_cache, cache.value_cache, tables,
                                               lens, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [None, 1, 8])
def test_decode_qwen3_shape_on_gpu(paged_cache, check_close, num_kv_splits):
    """The benchmark's layer shape (16 q heads, 8 KV heads, head dim 128, bf16) at real lengths."""
    seq_lens = torch.randint(1, 3000, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    seq_lens[0] = 2048  # an exact multiple of the block size
    cache = paged_cache(8 * 3000 // 16 + 16, 16, 8, 128, torch.bfloat16)
    tables = cache.block_tables(seq_lens)
    query = cache.randn(8, 16, 128, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_attention.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables, lens,
                                                 128**-0.5, num_kv_splits=num_kv_splits)
    expected = reference.paged_attention_decode(query.float(), cache.key_cache.float(),
                                                cache.value_cache.float(), tables, lens, 128**-0.5)
    check_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_addresses_a_cache_beyond_2_to_the_31_elements(check_close, num_kv_splits):
    """Blocks past element 2**31 are only reachable with 64-bit offsets (int32 would wrap)."""
    block_size, num_kv_heads, head_dim = 16, 8, 128
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 64  # ~4.3 GB per cache in bf16
    key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    value_cache = torch.empty_like(key_cache)
    blocks = torch.arange(num_blocks - 40, num_blocks, device=DEVICE)  # the top end of the cache
    key_cache[blocks] = torch.randn_like(key_cache[blocks])
    value_cache[blocks] = torch.randn_like(value_cache[blocks])
    tables = torch.stack([blocks[:20], blocks[20:]]).int()
    lens = torch.tensor([300, 317], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 16, head_dim, dtype=torch.bfloat16, device=DEVICE)
    out = paged_attention.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1,
                                                 num_kv_splits=num_kv_splits)
    expected = reference.paged_attention_decode(query.float(), key_cache[blocks].float(),
                                                value_cache[blocks].float(),
                                                torch.arange(40, device=DEVICE).view(2, 20).int(), lens, 0.1)
    check_close(out, expected, torch.bfloat16)
