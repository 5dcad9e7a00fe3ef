"""A tiny Llama and PEFT adapters for it, made by `peft` itself, with their merged models.

Each adapter is saved by `PeftModel.save_pretrained` (adapter_config.json +
adapter_model.safetensors) and merged into a copy of the base model by PEFT's
`merge_and_unload`: the fp32 reference the engine's greedy output must equal.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import engine_test_checkpoints as checkpoints

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Adapter:
    path: str
    merged: torch.nn.Module  # the base model with the adapter merged in (PEFT's merge)


def make_adapter(base, path: Path, seed: int, target_modules: list[str], r: int, lora_alpha: int,
                 use_rslora: bool = False) -> Adapter:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora,
                        init_lora_weights=False)  # random A and B: B = 0 would change nothing
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    peft_model.save_pretrained(path)
    return Adapter(str(path), peft_model.merge_and_unload().eval())


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory):
    """(checkpoint folder, transformers model) of the tiny Llama the adapters are made for."""
    path = tmp_path_factory.mktemp("lora-base") / "llama"
    return str(path), checkpoints.save_checkpoint("llama", path)


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory):
    """Two adapters: "all" (every projection, r=8, alpha=16) and "some" (q, v and down only,
    r=4, rsLoRA scaling alpha / sqrt(r))."""
    _, base = lora_base
    root = tmp_path_factory.mktemp("adapters")
    return {"all": make_adapter(base, root / "all", 1, ALL_MODULES, r=8, lora_alpha=16),
            "some": make_adapter(base, root / "some", 2, ["q_proj", "v_proj", "down_proj"], r=4, lora_alpha=8,
                                 use_rslora=True)}
