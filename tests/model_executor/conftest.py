"""Tiny random Hugging Face checkpoints of each Llama-family variant, built by transformers.

Each family differs from Llama in one feature our model must reproduce; the configs are as
small as possible while keeping that feature (GQA, rope scaling, biases, q/k norm, tying).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from minivllm.config import ModelConfig

_COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# family -> (config class, model class, config kwargs). Every feature a family adds is on.
FAMILIES = {
    # Llama 2: multi-head attention (as many KV heads as query heads), untied head.
    "llama2": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4)),
    # Llama 3.2: GQA, llama3 rope scaling, large theta, tied embeddings.
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    # Mistral: GQA and a head_dim that is not hidden_size / num_heads (as in Mistral Nemo).
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Qwen2: biases on q/k/v, tied embeddings (as Qwen2.5-0.5B).
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim, untied.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}


def build_hf_model(family: str, seed: int = 0):
    """A random transformers model of `family` in fp32, eval mode.

    transformers initializes biases to 0 and norm weights to 1, which would hide a bias or a
    norm weight we forgot to load; so every 1-D parameter gets noise too.
    """
    config_class, model_class, kwargs = FAMILIES[family]
    config = config_class(**_COMMON, **kwargs)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    return model


@pytest.fixture
def make_checkpoint(tmp_path):
    """make_checkpoint(family, max_shard_size=None) -> (hf_model, ModelConfig of the saved dir)."""

    def make(family: str, max_shard_size: str | None = None):
        hf_model = build_hf_model(family)
        path = tmp_path / family
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        hf_model.save_pretrained(path, safe_serialization=True, **kwargs)
        return hf_model, ModelConfig(model=str(path))

    return make
