"""`kernels/gemv.py`'s skinny linear against `F.linear` (cuBLAS / the CPU's matmul).

On a CPU the kernel runs in Triton's interpreter (fp32, exact to rounding); on the GPU also in
bf16 at the shapes of Qwen3-0.6B's projections (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 8), n=st.integers(1, 40), k=st.integers(1, 700), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_skinny_linear_is_f_linear(rows, n, k, bias, seed):
    from minivllm.kernels.gemv import skinny_linear

    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).to(DEVICE), torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    torch.testing.assert_close(skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_skinny_linear_reads_a_strided_row_view():
    """x may be rows of a wider tensor (a view with a row stride > K), as in the layers."""
    from minivllm.kernels.gemv import skinny_linear

    wide, w = torch.randn(3, 100, device=DEVICE), torch.randn(24, 60, device=DEVICE)
    x = wide[:, 20:80]
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_skinny_linear_refuses_what_it_cannot_do():
    from minivllm.kernels.gemv import MAX_ROWS, skinny_linear

    with pytest.raises(ValueError, match="M <="):
        skinny_linear(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(torch.randn(8, 2).T, torch.randn(4, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (151936, 1024)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_skinny_linear_bf16_on_the_gpu(n, k, rows):
    from minivllm.kernels.gemv import skinny_linear

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    out = skinny_linear(x, w, b)
    # fp32 accumulation in both: the difference is the final bf16 rounding (and cuBLAS's own).
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1.6e-2)
