"""get_model's choices and errors: architecture, dtype, weight files, hub ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config

from minivllm.config import ModelConfig
from minivllm.model_executor import get_model
from minivllm.model_executor.model_loader import resolve_dtype
from minivllm.model_executor.models import MODEL_REGISTRY


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"])
    model_config = ModelConfig(model=str(tmp_path), hf_config=config)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        get_model(model_config, "cpu")
    assert all(name in str(info.value) for name in MODEL_REGISTRY)


def test_tied_checkpoint_shares_one_matrix(make_checkpoint):
    _, model_config = make_checkpoint("qwen2")  # tie_word_embeddings=True
    model = get_model(model_config, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_checkpoint_loads_its_own_head(make_checkpoint):
    hf_model, model_config = make_checkpoint("qwen3")
    model = get_model(model_config, "cpu")
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, hf_model.lm_head.weight, atol=0, rtol=0)


def test_fused_qkv_and_gate_up_hold_the_separate_weights(make_checkpoint):
    hf_model, model_config = make_checkpoint("qwen2")
    model = get_model(model_config, "cpu")
    ours, theirs = model.model.layers[1], hf_model.model.layers[1]
    qkv = torch.cat([theirs.self_attn.q_proj.weight, theirs.self_attn.k_proj.weight,
                     theirs.self_attn.v_proj.weight])
    qkv_bias = torch.cat([theirs.self_attn.q_proj.bias, theirs.self_attn.k_proj.bias,
                          theirs.self_attn.v_proj.bias])
    gate_up = torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight])
    assert torch.equal(ours.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(ours.self_attn.qkv_proj.bias, qkv_bias)
    assert torch.equal(ours.mlp.gate_up_proj.weight, gate_up)


def test_auto_dtype_is_float32_on_cpu_even_for_a_bf16_checkpoint(make_checkpoint):
    _, model_config = make_checkpoint("llama2")
    model_config.hf_config.dtype = torch.bfloat16
    assert resolve_dtype("auto", model_config.hf_config, "cpu") == torch.float32
    # On a GPU the checkpoint's own half precision is used (no CUDA call needed to decide).
    assert resolve_dtype("auto", model_config.hf_config, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", model_config.hf_config, "cpu") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float13", model_config.hf_config, "cpu")


def test_explicit_bf16_weights_with_fp32_logits_and_rope_table(make_checkpoint):
    hf_model, model_config = make_checkpoint("llama3")
    model = get_model(model_config, "cpu", "bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # the loader restored it
    ids = torch.arange(7)
    from minivllm.attention import build_attn_metadata

    metadata = build_attn_metadata([[0, 1]], [0], [7], 1, 4)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, ids, [torch.empty(0)] * 2, metadata))
        expected = hf_model(ids[None]).logits[0]
    assert logits.dtype == torch.float32
    # bf16 keeps about 3 significant digits: close to the fp32 model, not equal.
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=5e-2)


def test_missing_weight_is_an_error(make_checkpoint):
    _, model_config = make_checkpoint("llama2")
    path = f"{model_config.model}/model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="gate_up_proj"):
        get_model(model_config, "cpu")


def test_unknown_weight_is_an_error(make_checkpoint):
    _, model_config = make_checkpoint("llama2")
    path = f"{model_config.model}/model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(ValueError, match="mystery"):
        get_model(model_config, "cpu")


def test_directory_without_safetensors_is_an_error(make_checkpoint, tmp_path):
    _, model_config = make_checkpoint("llama2")
    empty = tmp_path / "empty"
    empty.mkdir()
    model_config.model = str(empty)
    with pytest.raises(ValueError, match="safetensors"):
        get_model(model_config, "cpu")


def test_sharded_index_lists_the_files_read(make_checkpoint):
    _, model_config = make_checkpoint("llama2", max_shard_size="40KB")
    index = json.loads(open(f"{model_config.model}/model.safetensors.index.json").read())
    assert len(set(index["weight_map"].values())) > 1
    get_model(model_config, "cpu")  # every parameter found across the shards


def test_hub_id_that_cannot_be_fetched_is_a_clear_error(make_checkpoint, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network in tests
    _, model_config = make_checkpoint("llama2")
    model_config.model = "minivllm-tests/no-such-model"
    with pytest.raises(ValueError, match="not a local directory"):
        get_model(model_config, "cpu")


def test_checkpoint_that_disagrees_with_its_config_is_an_error(make_checkpoint):
    _, model_config = make_checkpoint("llama3")  # 2 KV heads in the weights
    model_config.hf_config.num_key_value_heads = 4
    with pytest.raises(ValueError, match="shard 'k' has shape"):
        get_model(model_config, "cpu")


def test_sliding_window_shorter_than_the_context_is_warned_about(make_checkpoint, caplog):
    _, model_config = make_checkpoint("mistral")
    model_config.hf_config.sliding_window = 16  # < max_model_len (64): full attention differs
    with caplog.at_level("WARNING", logger="minivllm.model_executor.model_loader"):
        get_model(model_config, "cpu")
    assert "sliding-window" in caplog.text
