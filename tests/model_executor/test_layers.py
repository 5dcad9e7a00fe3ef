"""Each layer against its transformers twin: RMSNorm, rotary embedding (both config layouts,
Llama 3 scaling), the SwiGLU MLP."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

from minivllm.model_executor.all_reduce_fusion import AllReduceRMSNorm
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    compute_inv_freq,
    get_rope_parameters,
)
from minivllm.model_executor.models.llama import LlamaMLP

HEAD_DIM = 32
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPE_CASES = {
    "default": dict(rope_theta=10000.0),
    "linear": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3": dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
}


def llama_config(**kwargs):
    return LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM,
                       intermediate_size=96, max_position_embeddings=512, **kwargs)


@pytest.mark.parametrize("norm_class", [RMSNorm, AllReduceRMSNorm])
def test_rmsnorm_matches_transformers_and_fuses_the_residual_add(norm_class):
    """AllReduceRMSNorm, the norm after a row-parallel layer, sums its input over the TP ranks
    first: with one rank that sum is the input, so it is this norm too."""
    torch.manual_seed(0)
    ours, theirs = norm_class(48, eps=1e-5), hf_llama.LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    if norm_class is RMSNorm:  # a norm after a row-parallel layer always has a residual
        assert torch.equal(ours(x), theirs(x))
    out, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, theirs(x + residual))


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_matches_transformers(case):
    config = llama_config(**ROPE_CASES[case])
    theirs = hf_llama.LlamaRotaryEmbedding(config).inv_freq
    ours = compute_inv_freq(HEAD_DIM, get_rope_parameters(config))
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_transformers_4_config_layout_reads_the_same():
    """transformers 4.x: `rope_theta` at the top level, scaling in `rope_scaling` (type key
    "rope_type", or "type" in older checkpoints); transformers 5 folds both into `rope_parameters`."""
    v5 = get_rope_parameters(llama_config(**ROPE_CASES["llama3"]))
    v4 = get_rope_parameters(SimpleNamespace(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING))
    assert v4 == v5
    old = get_rope_parameters(SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    assert old["rope_type"] == "linear" and old["rope_theta"] == 1e4
    assert get_rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == {
        "rope_type": "default", "rope_theta": 1e6}


def test_unsupported_rope_type_is_an_error():
    with pytest.raises(ValueError, match="yarn"):
        compute_inv_freq(HEAD_DIM, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rotary_embedding_matches_transformers(case):
    config = llama_config(**ROPE_CASES[case])
    rope = RotaryEmbedding(HEAD_DIM, config.max_position_embeddings, get_rope_parameters(config))
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 300, 7, 511])  # unordered, as in a mixed batch
    q, k = torch.randn(6, 4, HEAD_DIM), torch.randn(6, 2, HEAD_DIM)
    ours_q, ours_k = rope(positions, q, k)
    cos, sin = hf_llama.LlamaRotaryEmbedding(config)(q, positions[None])  # [1, tokens, head_dim]
    # transformers wants [batch, heads, tokens, head_dim].
    theirs_q, theirs_k = hf_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, theirs_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_k, theirs_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(HEAD_DIM, 128, {"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, HEAD_DIM), torch.randn(1, 1, HEAD_DIM)

    def score(query_pos, key_pos):
        rq, _ = rope(torch.tensor([query_pos]), q, q)
        _, rk = rope(torch.tensor([key_pos]), k, k)
        return (rq * rk).sum()

    torch.testing.assert_close(score(10, 3), score(100, 93), atol=1e-4, rtol=1e-4)


def test_swiglu_mlp_with_fused_gate_up_matches_transformers():
    config = llama_config()
    config.hidden_size, config.intermediate_size = 48, 80
    torch.manual_seed(0)
    theirs, ours = hf_llama.LlamaMLP(config), LlamaMLP(config)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
        ours.down_proj.weight.copy_(theirs.down_proj.weight)
    x = torch.randn(3, 48)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)


def test_only_silu_mlps_are_supported():
    config = llama_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="silu"):
        LlamaMLP(config)
