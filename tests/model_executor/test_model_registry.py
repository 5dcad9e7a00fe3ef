"""Out-of-tree models by architecture name (vLLM's `ModelRegistry.register_model`)."""

from __future__ import annotations

import json
import shutil

import pytest

from minivllm import LLM, ModelRegistry, SamplingParams
from minivllm.bundled_models import resolve_model
from minivllm.model_executor.models import MODEL_REGISTRY, LlamaForCausalLM, get_model_class

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class CountingLlama(LlamaForCausalLM):
    calls = 0

    def forward(self, *args, **kwargs):
        CountingLlama.calls += 1
        return super().forward(*args, **kwargs)


@pytest.fixture
def renamed_checkpoint(tmp_path):
    """The bundled checkpoint, its config naming an architecture minivllm does not know."""
    folder = tmp_path / "model"
    shutil.copytree(resolve_model(None), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["CountingLlamaForCausalLM"]}))
    yield str(folder)
    MODEL_REGISTRY.pop("CountingLlamaForCausalLM", None)


@pytest.mark.parametrize("model_cls", [CountingLlama, f"{__name__}:CountingLlama"])
def test_a_registered_model_serves_a_checkpoint(renamed_checkpoint, model_cls):
    with pytest.raises(ValueError, match="not supported"):
        LLM(model=renamed_checkpoint, device="cpu")
    ModelRegistry.register_model("CountingLlamaForCausalLM", model_cls)
    assert "CountingLlamaForCausalLM" in ModelRegistry.get_supported_archs()
    CountingLlama.calls = 0
    ours = LLM(model=renamed_checkpoint, device="cpu").generate(["ROMEO:"], GREEDY)[0].outputs[0].token_ids
    bundled = LLM(device="cpu").generate(["ROMEO:"], GREEDY)[0].outputs[0].token_ids
    assert ours == bundled and CountingLlama.calls > 0
    assert get_model_class(["CountingLlamaForCausalLM"]) is CountingLlama


def test_bad_registrations_are_refused():
    for arch, cls in (("", CountingLlama), ("X", "no_colon"), ("X", int)):
        with pytest.raises(ValueError):
            ModelRegistry.register_model(arch, cls)
