"""Attention over the paged KV cache: the metadata of one batch, the layer the model calls,
and the backend switch ("torch" references or "triton" kernels)."""

from minivllm.attention.layer import Attention
from minivllm.attention.metadata import AttentionMetadata, build_attn_metadata
from minivllm.attention.selector import get_attn_backend

__all__ = ["Attention", "AttentionMetadata", "build_attn_metadata", "get_attn_backend"]
