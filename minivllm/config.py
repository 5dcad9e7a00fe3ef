"""Engine configuration: one small dataclass per concern, as in `vllm/config.py` (v0).

No torch at import time: the scheduler (`minivllm.core`) reads `SchedulerConfig` and
`CacheConfig` in notebooks that load no model. `ModelConfig` reads the Hugging Face config
through transformers, and `DeviceConfig` asks torch for a GPU, only when they are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.bundled_models import resolve_model

# Without chunked prefill a whole prompt must fit in one step, so the token budget is at
# least the context length; vLLM v0 uses at least this many for throughput.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# With chunked prefill vLLM v0 defaults to a small budget to keep decode latency low.
_DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS = 512
_SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
_GiB = 1 << 30


@dataclass
class ModelConfig:
    """Which checkpoint to load and how.

    `model=None` or `"tiny-shakespeare"` means the model bundled with minivllm; any other
    string is a local directory or a Hugging Face hub id.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    revision: str | None = None
    hf_config: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.model = resolve_model(self.model)
        self.tokenizer = resolve_model(self.tokenizer) if self.tokenizer else self.model
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {self.dtype!r}.")
        if self.hf_config is None:
            from transformers import AutoConfig  # deferred: keeps this module torch-free

            self.hf_config = AutoConfig.from_pretrained(self.model, revision=self.revision)
        derived = _derive_max_model_len(self.hf_config)
        if self.max_model_len is None:
            self.max_model_len = derived
        elif not 0 < self.max_model_len <= derived:
            raise ValueError(
                f"max_model_len must be in [1, {derived}] (the model's context length), "
                f"got {self.max_model_len}."
            )

    # Shapes the cache engine needs.
    def get_num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def get_num_kv_heads(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    def get_head_size(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _derive_max_model_len(hf_config: Any) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 2048))


@dataclass
class CacheConfig:
    """The paged KV cache: block size, how much memory to use, and prefix caching.

    `num_gpu_blocks` and `num_cpu_blocks` are filled in by the worker's profile run
    (or by the user, for a model-free simulation).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}."
            )

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GiB)


@dataclass
class SchedulerConfig:
    """Budgets and policies of the scheduler.

    Args:
        max_num_batched_tokens: tokens per step (prompt chunks plus decode tokens).
        max_num_seqs: sequences per step.
        max_model_len: longest sequence (prompt plus output) the engine accepts.
        enable_chunked_prefill: mix decodes and prompt chunks in one step.
        preemption_mode: None (vLLM v0's rule), "recompute" or "swap".
        policy: "fcfs" or "priority".
        num_scheduler_steps: decode steps the GPU runs per `schedule()` (vLLM v0's
            multi-step scheduling). Above 1, each decoding sequence gets slots reserved for
            its next `num_scheduler_steps` tokens, and a decode-only batch runs that many
            forward passes back to back, feeding each step's sampled tokens into the next on
            the GPU, so the host's scheduling and batch preparation are paid once per
            `num_scheduler_steps` tokens instead of once per token.
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str | None = None
    policy: str = "fcfs"
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_num_batched_tokens is None:
            if self.enable_chunked_prefill:
                self.max_num_batched_tokens = _DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS
            else:
                self.max_num_batched_tokens = max(self.max_model_len, _DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): the longest prompt could never be "
                "scheduled. Raise max_num_batched_tokens, lower max_model_len, or enable "
                "chunked prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs a token slot."
            )
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be None, 'recompute' or 'swap', got {self.preemption_mode!r}."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}.")

    @property
    def num_lookahead_slots(self) -> int:
        """Slots a decoding sequence reserves beyond its next token (multi-step)."""
        return self.num_scheduler_steps - 1


@dataclass
class ParallelConfig:
    """Tensor and pipeline parallel sizes. minivllm runs one process; the executor interface
    leaves room for a multi-process tensor-parallel executor."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise ValueError(
                "minivllm runs on one device: tensor_parallel_size and pipeline_parallel_size "
                f"must be 1, got {self.tensor_parallel_size} and {self.pipeline_parallel_size}."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    """"auto" picks CUDA when a GPU is visible, else the CPU."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch  # deferred: keeps this module torch-free

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}.")

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]
