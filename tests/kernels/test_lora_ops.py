"""The multi-LoRA kernels (`kernels/lora_ops.py`) against their PyTorch references
(`kernels/lora_reference.py`), and the references against a per-row loop (the definition).

Every case runs on the GPU when there is one (the kernels need their tensors there), else in
Triton's interpreter on the CPU (fp32); on the GPU also in bf16 (`pytest -m gpu`), with a
decode-sized and a prefill-sized batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.kernels import lora_reference as ref
from minivllm.kernels.lora_reference import NO_LORA, LoRAMapping

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def per_row(x, lora_a, lora_b, idx, y, bounds):
    """The definition, one row and one slice at a time: y[t, slice s] += B_s[slot] (A_s[slot] x[t])
    for slot = idx[t] >= 0 (A_s: rows s*R:(s+1)*R of the stacked A; B_s: rows bounds[s]:bounds[s+1])."""
    out = y.clone().float()
    rank = lora_b.shape[2]
    for t, slot in enumerate(idx.tolist()):
        if slot == NO_LORA:
            continue
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            a_s = lora_a[slot, s * rank : (s + 1) * rank].float()
            out[t, lo:hi] += lora_b[slot, lo:hi].float() @ (a_s @ x[t].float())
    return out


def random_case(num_tokens, k, widths, rank, num_slots, dtype, seed, device=DEVICE):
    """x [T, K], A stacked over len(widths) slices [L, S*R, K], B [L, sum(widths), R], slots, y."""
    g = torch.Generator().manual_seed(seed)
    n, num_slices = sum(widths), len(widths)
    x = torch.randn(num_tokens, k, generator=g).to(device, dtype)
    lora_a = (torch.randn(num_slots, num_slices * rank, k, generator=g) / k**0.5).to(device, dtype)
    lora_b = torch.randn(num_slots, n, rank, generator=g).to(device, dtype)
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=g).to(device)
    y = torch.randn(num_tokens, n, generator=g).to(device, dtype)
    bounds = tuple(sum(widths[:i]) for i in range(num_slices + 1))
    return x, lora_a, lora_b, idx, y, bounds


def run(ops, x, lora_a, lora_b, idx, y, bounds):
    """(h summed over its planes, rows with a slot only; y after expand)."""
    mapping = LoRAMapping.build(idx, lora_a.shape[0])
    h = ops.lora_shrink(x, lora_a, mapping)
    out = y.clone()
    ops.lora_expand(h, lora_b, out, bounds, mapping)
    return h.sum(0)[idx != NO_LORA], out


def test_mapping_groups_rows_by_slot():
    m = LoRAMapping.build(torch.tensor([1, -1, 0, 1], device=DEVICE), 2)
    assert m.sorted_token_ids.tolist() == [1, 2, 0, 3]
    assert m.num_tokens_per_slot.tolist() == [1, 2] and m.slot_start.tolist() == [1, 2]


@settings(max_examples=25, deadline=None)
@given(num_tokens=st.integers(1, 12), num_slots=st.integers(1, 3), rank=st.integers(1, 8),
       widths=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_reference_is_the_per_row_definition(num_tokens, num_slots, rank, widths, seed):
    x, lora_a, lora_b, idx, y, bounds = random_case(num_tokens, 12, widths, rank, num_slots, torch.float32, seed)
    _, out = run(ref, x, lora_a, lora_b, idx, y, bounds)
    torch.testing.assert_close(out, per_row(x, lora_a, lora_b, idx, y, bounds), rtol=1e-5, atol=1e-5)
    untouched = idx == NO_LORA  # base-model rows are left exactly as they were
    assert torch.equal(out[untouched], y[untouched])


@pytest.mark.parametrize("num_tokens,k,widths,rank,num_slots", [
    (1, 16, [16], 16, 1),          # one decode row, every dimension at tl.dot's minimum
    (7, 40, [70], 8, 3),           # ragged: K and N not multiples of the tiles, rank below 16
    (37, 96, [33], 4, 2),          # more rows than a 16-row tile
    (9, 600, [20], 8, 2),          # split-K: three partial planes, added by expand
    (520, 16, [24], 4, 2),         # a prefill-sized batch: 64-row tiles, no split
    (11, 64, [48, 16, 16], 8, 3),  # q, k, v: three slices in one expand
    (5, 300, [40, 90], 4, 2),      # gate, up: a slice boundary inside a 64-column block, split-K
])
def test_triton_kernels_match_the_reference(num_tokens, k, widths, rank, num_slots):
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y, bounds = random_case(num_tokens, k, widths, rank, num_slots, torch.float32, num_tokens)
    h_ref, out_ref = run(ref, x, lora_a, lora_b, idx, y, bounds)
    h, out = run(lora_ops, x, lora_a, lora_b, idx, y, bounds)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), per_row(x, lora_a, lora_b, idx, y, bounds), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[idx == NO_LORA], y[idx == NO_LORA])


def test_split_k_leaves_planes_that_expand_adds():
    """On a small batch with a long K the Triton shrink returns several planes and no single
    one is the product; their sum is, and expand gives the reference's y from them."""
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y, bounds = random_case(9, 600, [20], 8, 2, torch.float32, 3)
    idx[0] = 0  # at least one row with an adapter
    mapping = LoRAMapping.build(idx, 2)
    h = lora_ops.lora_shrink(x, lora_a, mapping)
    assert h.shape[0] > 1
    rows = idx != NO_LORA
    product = ref.lora_shrink(x, lora_a, mapping)[0][rows]
    assert not torch.allclose(h[0][rows], product, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(h.sum(0)[rows], product, rtol=1e-5, atol=1e-5)
    out = y.clone()
    lora_ops.lora_expand(h, lora_b, out, bounds, mapping)
    torch.testing.assert_close(out, per_row(x, lora_a, lora_b, idx, y, bounds), rtol=1e-5, atol=1e-5)


def test_expand_never_reads_rows_without_an_adapter():
    """Whatever h holds on base-model rows (the Triton shrink leaves them unwritten), expand
    leaves those rows of y alone and the others right."""
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y, bounds = random_case(8, 32, [16, 16], 4, 2, torch.float32, 5)
    mapping = LoRAMapping.build(idx, 2)
    h = ref.lora_shrink(x, lora_a, mapping)
    h[:, idx == NO_LORA] = float("nan")
    for ops in (ref, lora_ops):
        out = y.clone()
        ops.lora_expand(h, lora_b, out, bounds, mapping)
        assert torch.equal(out[idx == NO_LORA], y[idx == NO_LORA])
        torch.testing.assert_close(out[idx != NO_LORA].float(),
                                   per_row(x, lora_a, lora_b, idx, y, bounds)[idx != NO_LORA], rtol=1e-5, atol=1e-5)


def test_expand_rejects_bounds_that_do_not_cover_the_output():
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y, _ = random_case(4, 16, [16, 16], 4, 1, torch.float32, 0)
    h = lora_ops.lora_shrink(x, lora_a, LoRAMapping.build(idx, 1))
    with pytest.raises(ValueError, match="slice_bounds"):
        lora_ops.lora_expand(h, lora_b, y, (0, 16, 24), LoRAMapping.build(idx, 1))


def test_triton_kernels_skip_a_batch_without_adapters():
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, _, y, bounds = random_case(5, 16, [16], 16, 2, torch.float32, 0)
    _, out = run(lora_ops, x, lora_a, lora_b, torch.full((5,), NO_LORA, device=DEVICE), y, bounds)
    assert torch.equal(out, y)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 256, 2048], ids=["decode", "decode-256", "prefill"])
def test_triton_kernels_bf16_on_the_gpu(num_tokens):
    from minivllm.kernels import lora_ops

    x, lora_a, lora_b, idx, y, bounds = random_case(num_tokens, 1024, [2048, 1024, 1024], 16, 8, torch.bfloat16, 0)
    h_ref, out_ref = run(ref, x, lora_a, lora_b, idx, y, bounds)
    h, out = run(lora_ops, x, lora_a, lora_b, idx, y, bounds)
    torch.testing.assert_close(h, h_ref, rtol=1e-3, atol=1e-3)  # both accumulate in fp32
    # Expand rounds h to bf16 before its product (as vLLM's does): 2^-9 of |h| (~3 here, B is
    # not scaled down) over 16 ranks shows as a few hundredths on outputs of magnitude ~10, and
    # y is rounded to bf16 once more (a step of 1/16 at 10).
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=1e-1)
    assert torch.equal(out[idx == NO_LORA], y[idx == NO_LORA])
