"""The model: layers (norms, rotary embedding, activation), the Llama-family decoder, and
the loader that builds it from a Hugging Face checkpoint."""

from minivllm.model_executor.model_loader import get_model

__all__ = ["get_model"]
