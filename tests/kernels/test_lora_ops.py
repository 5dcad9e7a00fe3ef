"""The multi-LoRA kernels (`kernels/lora_ops.py`) against their PyTorch references
(`kernels/lora_reference.py`), and the references against a per-row loop (the definition).

On a CPU the kernels run in Triton's interpreter (fp32); on the GPU also in bf16
(`pytest -m gpu`), with a decode-sized and a prefill-sized batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.kernels import lora_reference as ref
from minivllm.kernels.lora_reference import NO_LORA, LoRAMapping

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def per_row(x, lora_a, lora_b, idx, y, offset):
    """The definition, one row at a time: y[t, offset:] += B[s] (A[s] x[t]) for s = idx[t] >= 0."""
    out = y.clone().float()
    for t, slot in enumerate(idx.tolist()):
        if slot != NO_LORA:
            out[t, offset : offset + lora_b.shape[1]] += lora_b[slot].float() @ (lora_a[slot].float() @ x[t].float())
    return out


def random_case(num_tokens, k, n, rank, num_slots, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g).to(device, dtype)
    lora_a = (torch.randn(num_slots, rank, k, generator=g) / k**0.5).to(device, dtype)
    lora_b = torch.randn(num_slots, n, rank, generator=g).to(device, dtype)
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=g).to(device)
    y = torch.randn(num_tokens, n + 8, generator=g).to(device, dtype)
    return x, lora_a, lora_b, idx, y


def run(ops, x, lora_a, lora_b, idx, y, offset):
    mapping = LoRAMapping.build(idx, lora_a.shape[0])
    buf = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    ops.lora_shrink(x, lora_a, buf, mapping)
    out = y.clone()
    ops.lora_expand(buf, lora_b, out, offset, mapping)
    return buf, out


def test_mapping_groups_rows_by_slot():
    m = LoRAMapping.build(torch.tensor([1, -1, 0, 1]), 2)
    assert m.sorted_token_ids.tolist() == [1, 2, 0, 3]
    assert m.num_tokens_per_slot.tolist() == [1, 2] and m.slot_start.tolist() == [1, 2]


@settings(max_examples=25, deadline=None)
@given(num_tokens=st.integers(1, 12), num_slots=st.integers(1, 3), rank=st.integers(1, 8),
       offset=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_reference_is_the_per_row_definition(num_tokens, num_slots, rank, offset, seed):
    x, lora_a, lora_b, idx, y = random_case(num_tokens, 12, 10, rank, num_slots, torch.float32, seed)
    _, out = run(ref, x, lora_a, lora_b, idx, y, offset)
    torch.testing.assert_close(out, per_row(x, lora_a, lora_b, idx, y, offset), rtol=1e-5, atol=1e-5)
    untouched = idx == NO_LORA  # base-model rows are left exactly as they were
    assert torch.equal(out[untouched], y[untouched])


@pytest.mark.parametrize("num_tokens,k,n,rank,num_slots", [
    (1, 16, 16, 16, 1),      # one decode row, every dimension at tl.dot's minimum
    (7, 40, 70, 8, 3),       # ragged: K and N not multiples of the tiles, rank below 16
    (37, 96, 33, 4, 2),      # more rows than a 16-row tile
    (9, 600, 20, 8, 2),      # split-K: three partial planes summed
    (520, 16, 24, 4, 2),     # a prefill-sized batch: 64-row tiles, no split
])
def test_triton_kernels_match_the_reference(num_tokens, k, n, rank, num_slots):
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y = random_case(num_tokens, k, n, rank, num_slots, torch.float32, num_tokens)
    buf_ref, out_ref = run(ref, x, lora_a, lora_b, idx, y, 5)
    buf, out = run(lora_ops, x, lora_a, lora_b, idx, y, 5)
    torch.testing.assert_close(buf, buf_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[idx == NO_LORA], y[idx == NO_LORA])


def test_shrink_adds_into_buf():
    """Both implementations add into buf (split-K sums its partials into it): a non-zero buf
    keeps its value on base-model rows and gains the product on the others."""
    from minivllm.kernels import lora_ops

    x, lora_a, _, idx, _ = random_case(9, 600, 20, 8, 2, torch.float32, 3)
    mapping = LoRAMapping.build(idx, 2)
    start = torch.randn(9, 8)
    results = []
    for ops in (ref, lora_ops):
        buf = start.clone()
        ops.lora_shrink(x, lora_a, buf, mapping)
        results.append(buf)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    expected = start + torch.stack([x[t] @ lora_a[s].T if s >= 0 else torch.zeros(8) for t, s in enumerate(idx.tolist())])
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-5)


def test_triton_kernels_skip_a_batch_without_adapters():
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, _, y = random_case(5, 16, 16, 16, 2, torch.float32, 0)
    buf, out = run(lora_ops, x, lora_a, lora_b, torch.full((5,), NO_LORA), y, 0)
    assert not buf.any() and torch.equal(out, y)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 2048], ids=["decode", "prefill"])
def test_triton_kernels_bf16_on_the_gpu(num_tokens):
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y = random_case(num_tokens, 1024, 3072, 16, 8, torch.bfloat16, 0, device="cuda")
    buf_ref, out_ref = run(ref, x, lora_a, lora_b, idx, y, 8)
    buf, out = run(lora_ops, x, lora_a, lora_b, idx, y, 8)
    torch.testing.assert_close(buf, buf_ref, rtol=1e-3, atol=1e-3)  # both accumulate in fp32
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=1.6e-2, atol=1.6e-2)  # one bf16 rounding
    assert torch.equal(out[idx == NO_LORA], y[idx == NO_LORA])
