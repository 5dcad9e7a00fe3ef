"""Engine arguments with vLLM's names: `EngineArgs` -> the config dataclasses.

Mirrors `vllm/engine/arg_utils.py` (v0). One flat dataclass that a user fills in (or the
CLI parses), turned into the per-concern configs of `minivllm.config` by
`create_engine_config()`:

    args = EngineArgs(model="path/to/checkpoint", block_size=16, enable_prefix_caching=True)
    engine = LLMEngine.from_engine_args(args)

Every field is also a command-line flag (`--block-size`, `--enable-prefix-caching`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig


@dataclass
class EngineConfig:
    """All the configs of one engine (vLLM keeps the same bundle in `vllm/config.py`)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig
    attention_backend: str | None = None
    enforce_eager: bool = False


@dataclass
class EngineArgs:
    """Arguments for `LLMEngine` / `LLM`, with vLLM's names and defaults.

    model=None loads the bundled tiny-shakespeare model. `max_num_batched_tokens=None` picks
    vLLM's default (max(max_model_len, 2048); 512 with chunked prefill).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    preemption_mode: str | None = None
    scheduling_policy: str = "fcfs"
    num_scheduler_steps: int = 1
    attention_backend: str | None = None
    enforce_eager: bool = False

    def create_engine_config(self) -> EngineConfig:
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,
            num_scheduler_steps=self.num_scheduler_steps,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig(self.device),
            parallel_config=ParallelConfig(),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
        )

    # ------------------------------------------------------------------ command line
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per field (`max_num_seqs` -> `--max-num-seqs`)."""
        defaults = EngineArgs()
        for field in dataclasses.fields(EngineArgs):
            flag = "--" + field.name.replace("_", "-")
            default = getattr(defaults, field.name)
            help_text = _HELP.get(field.name, "")
            if field.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
            elif field.name in _CHOICES:
                parser.add_argument(flag, default=default, choices=_CHOICES[field.name], help=help_text)
            else:
                parser.add_argument(flag, type=_ARG_TYPES.get(field.name, str), default=default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


_ARG_TYPES = {
    "seed": int,
    "block_size": int,
    "gpu_memory_utilization": float,
    "num_gpu_blocks_override": int,
    "swap_space": float,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "num_scheduler_steps": int,
}
_CHOICES = {
    "dtype": ["auto", "float32", "float16", "bfloat16"],
    "device": ["auto", "cuda", "cpu"],
    "preemption_mode": [None, "recompute", "swap"],
    "scheduling_policy": ["fcfs", "priority"],
    "attention_backend": [None, "torch", "triton"],
}
_HELP = {
    "model": "local checkpoint folder or Hugging Face id (default: the bundled tiny-shakespeare)",
    "tokenizer": "tokenizer folder or id (default: the model's)",
    "dtype": "weights and activations dtype (auto: fp32 on CPU, the checkpoint's on GPU)",
    "device": "auto picks CUDA when available",
    "seed": "seed of the global RNG (requests without their own seed)",
    "block_size": "tokens per KV-cache block",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "num_gpu_blocks_override": "use exactly this many KV blocks (skips the memory profile)",
    "swap_space": "GiB of CPU memory for swapped-out KV blocks",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step",
    "max_model_len": "longest prompt + output (default: the model's context length)",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "enable_chunked_prefill": "split long prompts and mix them with decodes",
    "preemption_mode": "force recompute or swap (default: vLLM v0's rule)",
    "scheduling_policy": "fcfs, or priority (lower value first)",
    "num_scheduler_steps": "decode steps per schedule (multi-step scheduling; 8 is a good GPU value)",
    "attention_backend": "torch (PyTorch reference) or triton (default on GPU)",
    "enforce_eager": "never use CUDA graphs",
}
