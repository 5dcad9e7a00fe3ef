"""The fused Triton ops (`minivllm.kernels.fused_ops`) against the PyTorch layers they replace.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
on a GPU, natively. The PyTorch layer code (`forward_native`: the spec, also what transformers
computes) is what a layer built for the "torch" backend runs, the default here. fp32 must agree to float rounding; bf16 to one rounding step at
most on a few elements (the fp32 sum of squares may be accumulated in a different order,
and a one-ulp change before the weight can become two after it).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.metadata import build_attn_metadata
from minivllm.kernels import fused_ops
from minivllm.model_executor import get_model
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _close(actual, expected, dtype, few_differ: bool = True):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:  # a rounding step or two (bf16: 2^-8 relative), never more
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=1e-2)
        # Triton's CPU interpreter truncates fp32 -> bf16 (GPUs round to nearest), so the
        # last bit differs almost everywhere there; on a GPU only a few elements may differ.
        if DEVICE == "cuda" and few_differ:
            assert (actual != expected).float().mean() < 0.03


def _within_product_rounding(actual, expected, x):
    """bf16 rotary: PyTorch rounds each product (x1 * cos, x2 * sin) and then their sum; a
    kernel that rounds only the sum differs by at most the products' roundings plus one
    more rounding of the result. With bf16's unit roundoff u = 2^-8 and |cos|, |sin| <= 1:
    |actual - expected| <= u (|x1| + |x2|) + 2 u |expected|."""
    u = 2.0**-8
    half = x.shape[-1] // 2
    pair = x[..., :half].float().abs() + x[..., half:].float().abs()
    bound = u * torch.cat([pair, pair], dim=-1) + 2 * u * expected.float().abs()
    assert torch.all((actual.float() - expected.float()).abs() <= bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data = torch.randn(96, device=DEVICE).to(dtype)
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    residual = torch.randn(5, 96, device=DEVICE).to(dtype)
    _close(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype)
    out, new_residual = fused_ops.rms_norm(x, norm.weight, norm.eps, residual)
    ref_out, ref_residual = norm(x, residual)
    _close(new_residual, ref_residual, dtype)
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, two_shot", [(5, False), (5, True), (130, False)], ids=["one-shot", "two-shot", "many-rows"])
def test_all_reduce_add_rms_norm_over_one_rank_is_the_add_and_the_norm(dtype, rows, two_shot, monkeypatch):
    """The fused all-reduce kernels' arithmetic, with a world of one (the barrier has no peer):
    its own partial copied through its buffer is the sum, then the norm layer's add and norm.
    Over MAX_ROWS rows the two-shot runs. Two ranks, the barrier and CUDA graphs:
    tests/distributed/test_distributed_gpu.py."""
    from minivllm.kernels import custom_all_reduce

    monkeypatch.setattr(custom_all_reduce, "PROGRAMS", 16)  # two-shot programs of several rows each
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data = torch.randn(96, device=DEVICE).to(dtype)
    x, residual = (torch.randn(rows, 96, device=DEVICE).to(dtype) for _ in range(2))
    buffer = torch.full((2 * rows * 96,), float("nan"), device=DEVICE, dtype=dtype)
    signal_pad = torch.zeros(2 * custom_all_reduce.PROGRAMS, device=DEVICE, dtype=torch.int32)
    addresses = (torch.tensor([t.data_ptr()], device=DEVICE) for t in (buffer, signal_pad))
    args = (norm.eps, *addresses, 0, 1)
    out, new_residual = custom_all_reduce.all_reduce_add_rms_norm(x, residual, norm.weight, *args,
                                                                  two_shot=two_shot)
    ref_out, ref_residual = norm(x, residual)
    _close(new_residual, ref_residual, dtype)
    _close(out, ref_out, dtype)
    assert torch.equal(buffer[: rows * 96].view(rows, 96), x)  # the partial went through the shared buffer
    assert torch.equal(buffer[rows * 96:].view(rows, 96), x) == (two_shot or rows > custom_all_reduce.MAX_ROWS)
    assert not signal_pad.any()
    with pytest.raises(ValueError, match="unit last stride"):
        custom_all_reduce.all_reduce_add_rms_norm(x.t(), residual.t(), norm.weight, *args)
    with pytest.raises(ValueError, match="residual must be shaped like x"):
        custom_all_reduce.all_reduce_add_rms_norm(x, residual[:2], norm.weight, *args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_inside_a_strided_view(dtype):
    """Qwen3's q/k norm: per-head RMSNorm on a [tokens, heads, head_dim] view of the qkv output."""
    torch.manual_seed(1)
    heads, head_dim = 3, 16
    norm = RMSNorm(head_dim).to(DEVICE, dtype)
    norm.weight.data = torch.randn(head_dim, device=DEVICE).to(dtype)
    qkv = torch.randn(4, heads * head_dim + 32, device=DEVICE).to(dtype)
    q = qkv[:, : heads * head_dim].view(4, heads, head_dim)  # not contiguous
    _close(fused_ops.rms_norm(q, norm.weight, norm.eps), norm(q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(2)
    x = (3 * torch.randn(6, 2 * 40, device=DEVICE)).to(dtype)
    _close(fused_ops.silu_and_mul(x), SiluAndMul()(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}])
def test_rotary_on_strided_query_and_key(dtype, rope):
    """fp32: the PyTorch code's result. bf16: PyTorch rounds each product x1 * cos to bf16
    before the sum; the compiled kernel does not (Triton folds the round trip, measured on
    an H100: about a quarter of the outputs differ), so outputs differ by rounding only."""
    torch.manual_seed(3)
    head_dim, max_position = 16, 256
    rotary = RotaryEmbedding(head_dim, max_position, rope).to(DEVICE)
    qkv = torch.randn(7, (4 + 2 + 2) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : 4 * head_dim].view(7, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(7, 2, head_dim)
    positions = torch.tensor([0, 1, 5, 17, 100, 200, 255], device=DEVICE)
    ref_q, ref_k = rotary(positions, q, k)
    for x, ref in ((q, ref_q), (k, ref_k)):
        got = fused_ops.rotary(x, positions, rotary.cos_sin_cache)
        _close(got, ref, dtype, few_differ=False)
        if dtype == torch.bfloat16 and DEVICE == "cuda":  # (the interpreter truncates: see _close)
            _within_product_rounding(got, ref, x)


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        fused_ops.silu_and_mul(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError):
        fused_ops.rotary(torch.zeros(2, 3, 6), torch.zeros(2, dtype=torch.long), torch.zeros(8, 6))


def test_the_backend_is_bound_once_at_construction():
    norm = RMSNorm(8, backend="triton")
    assert norm.backend == "triton" and norm._forward == norm.forward_triton
    act = SiluAndMul()
    assert act.backend == "torch" and act._forward == act.forward_native  # "torch" by default
    with pytest.raises(ValueError, match="unknown backend"):
        RMSNorm(8, backend="cuda")


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_whole_model_on_fused_ops_matches_transformers(make_checkpoint, family, monkeypatch):
    """Every RMSNorm (q/k norms included), SiLU-and-mul and rotary of a model built for the
    "triton" backend runs its fused kernel (on the CPU through the interpreter): transformers'
    logits all the same."""
    hf_model, model_config = make_checkpoint(family)
    calls = []
    for name in ("rms_norm", "silu_and_mul", "rotary"):
        kernel = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *args, _kernel=kernel, **kw: calls.append(1) or _kernel(*args, **kw))
    model = get_model(model_config, DEVICE, "float32", "triton")
    hf_model = hf_model.to(DEVICE)
    prompt = torch.tensor([(7 * i + 3) % hf_model.config.vocab_size for i in range(20)], device=DEVICE)
    metadata = build_attn_metadata([[0, 1]], [0], [len(prompt)], num_prefills=1, block_size=16, device=DEVICE)
    no_cache = [torch.empty(0, device=DEVICE) for _ in model.model.layers]  # attention within the prompt
    with torch.no_grad():
        ours = model.compute_logits(model(prompt, torch.arange(len(prompt), device=DEVICE), no_cache, metadata))
        expected = hf_model(prompt.unsqueeze(0)).logits[0]
    assert len(calls) >= 4 * len(model.model.layers) + 1  # 2 norms, SiLU, rotary per layer; final norm
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_attention_fuses_norms_rotary_and_cache_write_over_a_paged_cache(make_checkpoint, family, monkeypatch):
    """With a KV cache, a "triton" model's attention runs q/k norm + rotary + the cache write as
    one kernel per layer (Llama: no norms, llama3 rope; Qwen3: norms), and the step's
    attention reads the keys it wrote: a prompt, then two decode steps, all of transformers'
    logits. A "torch" model on the same inputs never calls the kernel."""
    hf_model, model_config = make_checkpoint(family)
    fused = fused_ops.qk_norm_rope_and_cache
    calls = []
    monkeypatch.setattr(fused_ops, "qk_norm_rope_and_cache", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    config = hf_model.config
    tokens = torch.tensor([(5 * i + 1) % config.vocab_size for i in range(11)], device=DEVICE)
    block_size, table = 4, [3, 0, 5]  # scattered blocks
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for backend in ("triton", "torch"):
        model = get_model(model_config, DEVICE, "float32", backend)
        kv_caches = [torch.zeros(2, 6, block_size, config.num_key_value_heads, head_dim, device=DEVICE)
                     for _ in model.model.layers]
        logits = []
        for context, query in ((0, 9), (9, 1), (10, 1)):  # prefill, then decodes
            md = build_attn_metadata([table], [context], [query], num_prefills=int(query > 1),
                                     block_size=block_size, device=DEVICE)
            positions = torch.arange(context, context + query, device=DEVICE)
            with torch.no_grad():
                hidden = model(tokens[context:context + query], positions, kv_caches, md)
                logits.append(model.compute_logits(hidden))
        with torch.no_grad():
            expected = hf_model.to(DEVICE)(tokens.unsqueeze(0)).logits[0]
        torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)
        assert len(calls) == (3 * len(model.model.layers) if backend == "triton" else 0)
        calls.clear()
