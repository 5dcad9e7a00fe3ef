"""`kernels/gemv.py` (one token times a weight) against `F.linear`, and the linear layers'
dispatch to it: only one bf16/fp16 token on a GPU on the "triton" backend.

On the CPU the kernel runs in Triton's interpreter at small shapes, with ragged N and K (not
multiples of the tiles); on the GPU machine also at the Qwen3-0.6B and Llama-3-8B layer shapes
in bf16 (`-m gpu`), where it is the batch-1 decode path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels import gemv as gemv_module
from minivllm.kernels.gemv import gemv
from minivllm.model_executor.layers import linear
from minivllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_problem(n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("n, k, bias", [(8, 16, False), (13, 700, True), (3, 1500, False), (64, 512, True)])
def test_gemv_matches_f_linear_fp32(n, k, bias):
    x, w, b = random_problem(n, k, torch.float32, bias)
    out = gemv(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (1, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # Qwen3-0.6B
                                  (6144, 4096), (28672, 4096), (4096, 14336), (1000, 1000)])  # Llama-3-8B, ragged
def test_gemv_real_shapes_on_gpu(dtype, n, k):
    x, w, b = random_problem(n, k, dtype, bias=n == 1000)
    out = gemv(x, w, b)
    # The exact sum, rounded once to the dtype: the kernel may differ from it by one rounding step.
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out, exact.to(dtype), rtol=1e-2 if dtype == torch.bfloat16 else 2e-3, atol=1e-3)
    assert out.dtype == dtype


def test_gemv_rejects_what_it_does_not_compute():
    x, w, _ = random_problem(4, 8, torch.float32, bias=False)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(x.expand(2, 8), w)  # two tokens
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(x[:, :4], w)  # K mismatch
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, w.t().contiguous().t())


@pytest.mark.parametrize("layer_class", [ColumnParallelLinear, RowParallelLinear])
def test_linear_layers_take_the_gemv_for_one_half_precision_token_on_a_gpu(monkeypatch, layer_class):
    """The dispatch, seen through a spy: which inputs reach the GEMV, and the layer's output is
    the GEMV's (the GPU) or F.linear's (everything else)."""
    calls = []

    def spy(x, weight, bias=None):
        calls.append(tuple(x.shape))
        return gemv(x, weight, bias)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    layers = {backend: layer_class(32, 16, bias=True, backend=backend) for backend in ("torch", "triton")}
    for layer in layers.values():
        layer.weight.data.normal_()
        layer.bias.data.normal_()
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    for backend, layer in layers.items():
        layer.to(DEVICE, dtype)
        for tokens in (1, 3):
            x = torch.randn(tokens, 32, device=DEVICE, dtype=dtype)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)
    # Only the "triton" layer, one token, on a GPU: the CPU and fp32 keep F.linear.
    assert calls == ([(1, 32)] if DEVICE == "cuda" else [])


def test_the_dispatch_keeps_f_linear_for_fp32_and_cpu():
    method = linear.UnquantizedLinearMethod("triton")
    x, w, b = random_problem(8, 16, torch.float32, bias=True)
    assert torch.equal(method(x, w, b), F.linear(x, w, b))  # fp32: cuBLAS, for parity with transformers


@pytest.mark.parametrize("case", ["strided x", "strided weight", "weight in another dtype"])
def test_layouts_the_gemv_does_not_read_keep_f_linear(monkeypatch, case):
    """A one-token input the GEMV would refuse (or misread) goes to F.linear, never to gemv."""
    monkeypatch.setattr(gemv_module, "gemv", lambda *args: pytest.fail("reached the GEMV"))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, w, _ = random_problem(8, 16, dtype, bias=False)
    if case == "strided x":  # made in its dtype: a cast would copy it to unit strides
        x = torch.randn(16, 2, device=DEVICE, dtype=dtype)[:, :1].t()
    elif case == "strided weight":
        w = w.t().contiguous().t()
    else:
        w = w.double()
    method = linear.UnquantizedLinearMethod("triton")
    if case == "weight in another dtype":
        with pytest.raises(RuntimeError):  # F.linear's own error, not a silent mixed-dtype product
            method(x, w, None)
    else:
        torch.testing.assert_close(method(x, w, None), F.linear(x, w))
