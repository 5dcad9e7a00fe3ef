"""Checkpoints for the multi-process tests: the engine tests' tiny families plus Mistral.

Every model has 4 query heads and 2 KV heads, so TP=4 replicates each KV head on two ranks,
and 2 layers, so PP=2 gives each stage one.
"""

import sys

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

checkpoints = sys.modules["engine_test_checkpoints"]  # registered by tests/conftest.py
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _build_mistral(path):
    config = MistralConfig(**checkpoints._COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=False)
    config.architectures = ["MistralForCausalLM"]
    # As checkpoints.build_hf_model: noise on 1-D weights, so a norm or bias left unloaded shows.
    torch.manual_seed(1)
    model = MistralForCausalLM(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    checkpoints.build_tokenizer().save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def parallel_checkpoints(tmp_path_factory):
    """family -> (folder, transformers model), saved once per session."""
    root = tmp_path_factory.mktemp("parallel-checkpoints")
    saved = {family: (str(root / family), checkpoints.save_checkpoint(family, root / family))
             for family in ("llama", "qwen2", "qwen3")}
    saved["mistral"] = (str(root / "mistral"), _build_mistral(root / "mistral"))
    return saved
