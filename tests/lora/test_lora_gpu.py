"""Multi-LoRA on a GPU: CUDA-graph decode (the LoRA kernels captured once, replayed for every
mix of adapters) and multi-step decode give the eager engine's tokens, with more adapters than
GPU slots. Run on the GPU machine with `pytest -m gpu tests/lora`.

The adapters are written by hand (PEFT's file format, no peft needed on that machine)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from minivllm import LLM, SamplingParams
from minivllm.bundled_models import resolve_model
from minivllm.lora.peft_helper import module_shapes
from minivllm.lora.request import LoRARequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed", "KING:", "LEAR:", "Nurse:"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path, seed: int, rank: int = 8):
    config = AutoConfig.from_pretrained(resolve_model(None))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_f, in_f) in module_shapes(config).items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.05
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}))
    return str(path)


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-adapters")
    return [LoRARequest(f"a{i}", i + 1, write_adapter(root / f"a{i}", i)) for i in range(3)]


def greedy(loras, **engine_args) -> list[list[int]]:
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.4,
              enable_lora=True, max_loras=2, max_lora_rank=8, **engine_args)
    per_prompt = [loras[0], None, loras[1], loras[2], loras[0], None]  # three adapters, two slots
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora_request=per_prompt, use_tqdm=False)]
    del llm
    gc.collect()
    return tokens


def test_cuda_graphs_and_multi_step_give_the_eager_tokens(loras):
    eager = greedy(loras, enforce_eager=True)
    assert greedy(loras) == eager
    assert greedy(loras, num_scheduler_steps=4) == eager
    assert eager[0] != greedy([None, None, None], enforce_eager=True)[0]  # the adapter changes the output
