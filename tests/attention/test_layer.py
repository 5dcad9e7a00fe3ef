"""The Attention layer against dense attention (torch SDPA) on the same keys and values.

The batch mixes a fresh prompt, a prompt chunk after cached context, and decodes. The
context's keys/values are placed in the cache by hand (slot formula), the layer writes the
new ones, and each token's output must equal SDPA over that sequence's whole key list.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from minivllm.attention import Attention, build_attn_metadata

BLOCK_SIZE, NUM_BLOCKS = 4, 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
SCALE = HEAD_DIM**-0.5
CONTEXT_LENS, QUERY_LENS, NUM_PREFILLS = [0, 6, 5, 8], [5, 3, 1, 1], 2


def dense_attention(q, k, v, num_context):
    """SDPA with an explicit mask: query i (at position num_context + i) sees keys <= it."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    query_pos = num_context + torch.arange(q.shape[0])
    mask = torch.arange(k.shape[0])[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)


def make_batch():
    g = torch.Generator().manual_seed(0)
    blocks = iter(torch.randperm(NUM_BLOCKS, generator=g).tolist())
    seq_lens = [c + q for c, q in zip(CONTEXT_LENS, QUERY_LENS)]
    tables = [[next(blocks) for _ in range(math.ceil(n / BLOCK_SIZE))] for n in seq_lens]
    # Every sequence's keys/values for all its positions; context ones go into the cache now.
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) for n in seq_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) for n in seq_lens]
    queries = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=g) for q in QUERY_LENS]
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    for table, c, k, v in zip(tables, CONTEXT_LENS, keys, values):
        for pos in range(c):
            kv_cache[0, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            kv_cache[1, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
    return tables, keys, values, queries, kv_cache


def check_layer(backend, device="cpu", dtype=torch.float32, tol=1e-5):
    tables, keys, values, queries, kv_cache = make_batch()
    # Round the inputs to `dtype` once; the dense reference runs in fp32 on those values.
    keys, values, queries = ([t.to(dtype).float() for t in ts] for ts in (keys, values, queries))
    new = [slice(c, c + q) for c, q in zip(CONTEXT_LENS, QUERY_LENS)]
    q = torch.cat(queries)
    k = torch.cat([k[s] for k, s in zip(keys, new)])
    v = torch.cat([v[s] for v, s in zip(values, new)])
    md = build_attn_metadata(tables, CONTEXT_LENS, QUERY_LENS, NUM_PREFILLS, BLOCK_SIZE, device)
    layer = Attention(NUM_HEADS, HEAD_DIM, SCALE, NUM_KV_HEADS, backend=backend)
    kv_cache = kv_cache.to(device, dtype)
    out = layer(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), kv_cache, md)
    expected = torch.cat([dense_attention(qs, ks, vs, c)
                          for qs, ks, vs, c in zip(queries, keys, values, CONTEXT_LENS)])
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
    # The new keys/values were written to their slots.
    key_slots = kv_cache[0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(key_slots[md.slot_mapping].float().cpu(), k, atol=0, rtol=0)


def test_layer_matches_dense_attention_torch_backend():
    check_layer("torch")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on the CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py "
                           "without a GPU); on a GPU the bf16 test below covers it")
def test_layer_matches_dense_attention_triton_interpreter():
    check_layer("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_matches_dense_attention_triton_on_gpu_in_bf16():
    check_layer("triton", device="cuda", dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.parametrize("query_lens", [[4, 1, 3], [3, 3, 3, 2, 2, 0, 2, 4]])
def test_empty_kv_cache_means_causal_attention_without_context(query_lens):
    """Each sequence attends causally to itself only; runs of equal lengths share one call."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(sum(query_lens), NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(sum(query_lens), NUM_KV_HEADS, HEAD_DIM, generator=g)
    num_seqs = len(query_lens)
    md = build_attn_metadata([[0]] * num_seqs, [0] * num_seqs, query_lens, num_seqs, BLOCK_SIZE)
    out = Attention(NUM_HEADS, HEAD_DIM, SCALE, NUM_KV_HEADS)(q, k, v, torch.empty(0), md)
    expected = torch.cat([dense_attention(qs, ks, vs, 0) for qs, ks, vs in
                          zip(q.split(query_lens), k.split(query_lens), v.split(query_lens))])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_heads_must_group_evenly():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(6, HEAD_DIM, SCALE, 4)
