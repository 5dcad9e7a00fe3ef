"""Model registry: the `architectures` name in a Hugging Face config -> our model class.

As in vLLM's `ModelRegistry`, the checkpoint's config.json says which class to build, and a
model written outside minivllm plugs in by name, with no fork:

    from minivllm import ModelRegistry
    ModelRegistry.register_model("MyLlamaForCausalLM", MyLlamaForCausalLM)   # or "my_pkg.models:MyLlama"

A class given as "module:Class" is imported only when a checkpoint asks for it. Registering
in your script reaches workers in this process; for worker processes (tensor parallelism,
`mp`), register from a `minivllm.general_plugins` entry point (`minivllm.plugins`), which every
process loads.
"""

from __future__ import annotations

import importlib
import logging

from torch import nn

from minivllm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module] | str] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


logger = logging.getLogger(__name__)


class ModelRegistry:
    """vLLM's `ModelRegistry`, over `MODEL_REGISTRY` (architecture name -> class, or a
    "module:Class" string imported when first asked for)."""

    @staticmethod
    def register_model(model_arch: str, model_cls: type[nn.Module] | str) -> None:
        if not isinstance(model_arch, str) or not model_arch:
            raise ValueError(f"model_arch must be an architecture name, got {model_arch!r}.")
        if isinstance(model_cls, str) and model_cls.count(":") != 1:
            raise ValueError(f"a model class given by name must read 'module:Class', got {model_cls!r}.")
        if not isinstance(model_cls, str) and not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            raise ValueError(f"model_cls must be an nn.Module subclass or 'module:Class', got {model_cls!r}.")
        if model_arch in MODEL_REGISTRY:
            logger.warning("model architecture %s is already registered; %s now replaces it", model_arch, model_cls)
        MODEL_REGISTRY[model_arch] = model_cls

    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(MODEL_REGISTRY)

    @staticmethod
    def resolve_model_cls(model_arch: str) -> type[nn.Module]:
        model_cls = MODEL_REGISTRY[model_arch]
        if isinstance(model_cls, str):
            module_name, class_name = model_cls.split(":")
            model_cls = MODEL_REGISTRY[model_arch] = getattr(importlib.import_module(module_name), class_name)
        return model_cls


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first architecture we support; ValueError naming the supported ones."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return ModelRegistry.resolve_model_cls(name)
    raise ValueError(
        f"model architecture {architectures} is not supported; minivllm supports "
        f"{sorted(MODEL_REGISTRY)}."
    )


__all__ = ["MODEL_REGISTRY", "ModelRegistry", "get_model_class", "LlamaForCausalLM", "MistralForCausalLM",
           "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
