"""The Triton paged prefill kernel against the PyTorch reference (checked against SDPA elsewhere).

The cache is written the way the attention layer does it: reshape_and_cache stores the new
tokens' keys/values, then the kernel reads context and new tokens alike from the paged cache.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import prefill_attention, reference
from minivllm.kernels.reshape_and_cache import reshape_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [  # the interpreter's bf16 dot is wrong: bf16 on the GPU only
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]
CASES = [  # num_heads, num_kv_heads, head_dim, block_size
    pytest.param(2, 2, 64, 16, id="group1-d64-bs16"),
    pytest.param(4, 2, 128, 8, id="group2-d128-bs8"),
    pytest.param(8, 2, 32, 32, id="group4-d32-bs32"),
    pytest.param(8, 1, 64, 8, id="group8-d64-bs8"),
]


def _slots(table, start, end, block_size):
    """Slots of tokens start..end-1 of a sequence, by the contract's formula."""
    return [int(table[t // block_size]) * block_size + t % block_size for t in range(start, end)]


def _prefill(paged_cache, shapes, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Run kernel and reference on one batch. shapes: (cached context, new tokens) per sequence."""
    seq_lens = [c + n for c, n in shapes]
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    cache = paged_cache(num_blocks + 4, block_size, num_kv_heads, head_dim, dtype)
    tables = cache.block_tables(seq_lens)
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    num_tokens = starts[-1]
    # The new tokens' K/V go into the cache first, as in the attention layer.
    slot_mapping = torch.tensor(sum((_slots(tables[i], c, c + n, block_size) for i, (c, n) in enumerate(shapes)), []),
                                device=DEVICE)
    key, value = (cache.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
    reshape_and_cache(key, value, cache.key_cache, cache.value_cache, slot_mapping)
    query = cache.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    args = (tables, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), head_dim**-0.5)
    out = prefill_attention.paged_prefill_attention(query, cache.key_cache, cache.value_cache, *args)
    expected = reference.paged_prefill_attention(query.float(), cache.key_cache.float(),
                                                 cache.value_cache.float(), *args)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_prefill_matches_reference(paged_cache, check_close, dtype, num_heads, num_kv_heads, head_dim, block_size):
    # (context, new): one-token prompt, a prompt of exactly two blocks, a block-aligned
    # prefix-cache hit, and a chunked-prefill continuation that starts mid-block.
    shapes = [(0, 1), (0, 2 * block_size), (block_size, 5), (7, block_size + 2)]
    out, expected = _prefill(paged_cache, shapes, num_heads, num_kv_heads, head_dim, block_size, dtype)
    assert out.dtype == dtype
    check_close(out, expected, dtype)


def test_prefill_of_a_padded_batch_matches_the_unpadded_one(paged_cache, check_close):
    """A prefill CUDA graph's layout: sequences of 0 tokens and rows past the last sequence
    (a batch padded to the graph's shape) leave every real row as the unpadded batch has it."""
    cache = paged_cache(64, 8, 2, 32, torch.float32)
    int32 = dict(dtype=torch.int32, device=DEVICE)
    tables = cache.block_tables([23, 2, 49])
    starts, seq_lens = torch.tensor([0, 20, 22, 62], **int32), torch.tensor([23, 2, 49], **int32)
    query, kv = cache.randn(62, 4, 32, dtype=torch.float32), (cache.key_cache, cache.value_cache)
    out = prefill_attention.paged_prefill_attention(query, *kv, tables, starts, seq_lens, 0.2)
    check_close(out, reference.paged_prefill_attention(query, *kv, tables, starts, seq_lens, 0.2), torch.float32)

    pad_seqs = 5  # and 37 rows of no sequence
    padded = prefill_attention.paged_prefill_attention(
        torch.cat([query, cache.randn(37, 4, 32, dtype=torch.float32)]), *kv,
        torch.cat([tables, torch.zeros(pad_seqs, tables.shape[1], **int32)]),
        torch.cat([starts, starts[-1:].repeat(pad_seqs)]), torch.cat([seq_lens, torch.zeros(pad_seqs, **int32)]), 0.2)
    assert torch.equal(padded[:62], out)


@pytest.mark.gpu
def test_prefill_long_prompts_on_gpu(paged_cache, check_close):
    """Qwen3-like shape, prompts spanning many query tiles and key tiles, with cached context."""
    shapes = [(0, 700), (256, 300), (33, 129)]
    out, expected = _prefill(paged_cache, shapes, 16, 8, 128, 16, torch.bfloat16)
    check_close(out, expected, torch.bfloat16)
