"""Model registry: the `architectures` name in a Hugging Face config -> our model class.

As in vLLM's `ModelRegistry`, the checkpoint's config.json says which class to build.
"""

from __future__ import annotations

from torch import nn

from minivllm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first architecture we support; ValueError naming the supported ones."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"model architecture {architectures} is not supported; minivllm supports "
        f"{sorted(MODEL_REGISTRY)}."
    )


__all__ = ["MODEL_REGISTRY", "get_model_class", *MODEL_REGISTRY]
