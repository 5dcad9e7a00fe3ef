"""The PyTorch references against things nobody here wrote: dense SDPA and plain indexing.

Every Triton kernel is tested against `minivllm.kernels.reference`, so the reference itself is
checked here against `torch.nn.functional.scaled_dot_product_attention` on contiguous K/V
gathered token by token with the slot formula of the contract.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels import get_ops, reference


def _dense_kv(cache, block_table, seq_len):
    """Token t's key/value read from slot block_table[t // bs] * bs + t % bs, one at a time."""
    bs = cache.block_size
    slots = [int(block_table[t // bs]) * bs + t % bs for t in range(seq_len)]
    flat_k = cache.key_cache.reshape(-1, *cache.key_cache.shape[2:])
    flat_v = cache.value_cache.reshape(-1, *cache.value_cache.shape[2:])
    return flat_k[slots], flat_v[slots]


def _sdpa(query, keys, values, scale, attn_mask):
    """SDPA with each KV head repeated for its query heads. query [n, H, D], keys [L, Hkv, D]."""
    group = query.shape[1] // keys.shape[1]
    q = query.float().transpose(0, 1)  # [H, n, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (4, 4, 32, 8), (8, 4, 64, 16), (8, 2, 128, 32), (8, 1, 64, 8),
])
def test_decode_reference_matches_sdpa(paged_cache, num_heads, num_kv_heads, head_dim, block_size):
    seq_lens = [1, block_size, 2 * block_size, 3 * block_size - 1]
    cache = paged_cache(32, block_size, num_kv_heads, head_dim, torch.float32)
    tables = cache.block_tables(seq_lens)
    query = cache.randn(len(seq_lens), num_heads, head_dim, dtype=torch.float32)
    scale = head_dim**-0.5
    out = reference.paged_attention_decode(query, cache.key_cache, cache.value_cache, tables,
                                           torch.tensor(seq_lens, dtype=torch.int32), scale)
    for i, n in enumerate(seq_lens):
        keys, values = _dense_kv(cache, tables[i], n)
        expected = _sdpa(query[i : i + 1], keys, values, scale, attn_mask=None)[0]
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(8, 2, 64, 8), (4, 4, 32, 16)])
def test_prefill_reference_matches_sdpa_with_context(paged_cache, num_heads, num_kv_heads, head_dim, block_size):
    # (cached context, new tokens): plain prompt, prefix-cache hit (block-aligned), chunked prefill.
    shapes = [(0, 1), (0, 2 * block_size), (block_size, 5), (7, 9)]
    seq_lens = [c + n for c, n in shapes]
    cache = paged_cache(32, block_size, num_kv_heads, head_dim, torch.float32)
    tables = cache.block_tables(seq_lens)
    query_lens = [n for _, n in shapes]
    starts = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    query = cache.randn(starts[-1], num_heads, head_dim, dtype=torch.float32)
    scale = 0.3
    out = reference.paged_prefill_attention(
        query, cache.key_cache, cache.value_cache, tables,
        torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), scale)
    for i, (context, new) in enumerate(shapes):
        keys, values = _dense_kv(cache, tables[i], context + new)
        # SDPA's boolean mask: True = may attend. Row i sees keys 0 .. context + i.
        mask = torch.ones(new, context + new, dtype=torch.bool, device=query.device).tril(diagonal=context)
        expected = _sdpa(query[starts[i] : starts[i + 1]], keys, values, scale, attn_mask=mask)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_reference_writes_slots_and_skips_padding(paged_cache):
    cache = paged_cache(6, 4, 2, 8, torch.float32)
    before = cache.kv_cache.clone()
    key, value = cache.randn(4, 2, 8, dtype=torch.float32), cache.randn(4, 2, 8, dtype=torch.float32)
    slot_mapping = torch.tensor([5, -1, 0, 23], device=key.device)  # 23 = block 5, offset 3
    reference.reshape_and_cache(key, value, cache.key_cache, cache.value_cache, slot_mapping)
    expected = before.clone()
    for token, slot in [(0, 5), (2, 0), (3, 23)]:
        expected[0, slot // 4, slot % 4] = key[token]
        expected[1, slot // 4, slot % 4] = value[token]
    assert torch.equal(cache.kv_cache, expected)  # token 1 (slot -1) wrote nothing


def test_copy_and_swap_reference_move_whole_blocks(paged_cache):
    layers = [paged_cache(5, 4, 2, 8, torch.float32, seed=s).kv_cache for s in range(2)]
    before = [layer.clone() for layer in layers]
    reference.copy_blocks(layers, torch.tensor([[0, 3], [2, 4]], device=layers[0].device))
    for layer, old in zip(layers, before):
        assert torch.equal(layer[:, 3], old[:, 0]) and torch.equal(layer[:, 4], old[:, 2])
        assert torch.equal(layer[:, :3], old[:, :3])
    cpu_pool = torch.zeros(2, 3, 4, 2, 8)
    reference.swap_blocks(layers[0], cpu_pool, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(cpu_pool[:, 0], layers[0][:, 4].cpu()) and torch.equal(cpu_pool[:, 2], layers[0][:, 1].cpu())
    assert torch.equal(cpu_pool[:, 1], torch.zeros_like(cpu_pool[:, 1]))


def test_get_ops_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cuda")
    assert set(vars(get_ops("torch"))) == {"reshape_and_cache", "paged_attention_decode",
                                          "paged_prefill_attention", "copy_blocks", "swap_blocks"}


def test_importing_the_package_and_reference_does_not_import_triton():
    code = "import sys, minivllm.kernels, minivllm.kernels.reference; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
