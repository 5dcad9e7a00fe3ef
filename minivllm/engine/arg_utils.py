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
import typing
from dataclasses import dataclass

from minivllm.config import (DEFAULT_BLOCK_MANAGER_CLS, DEFAULT_SCHEDULER_CLS, CacheConfig, DeviceConfig,
                             EngineConfig, KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig)


# Multi-step by default where it can run: one schedule and one host round trip per 8 decode
# steps keeps the GPU busy while the host processes the previous run (docs/benchmarks.md).
DEFAULT_GPU_SCHEDULER_STEPS = 8


def _arg(default, help: str, choices: tuple[str, ...] | None = None, short: str | None = None):
    """A field whose `metadata` describes its command-line flag (help text, allowed values,
    a short alias such as "-tp").

    A field whose default is None says in `help` what None means, "(default: ...)"."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if short is not None:
        metadata["short"] = short
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    """Arguments for `LLMEngine` / `LLM`, with vLLM's names and defaults.

    model=None loads the bundled tiny-shakespeare model. `max_num_batched_tokens=None` picks
    vLLM's default (max(max_model_len, 2048); 512 with chunked prefill). Each field's
    `metadata` holds its flag's help text and choices (`add_cli_args`).
    """

    model: str | None = _arg(None, "local checkpoint folder or Hugging Face hub id "
                                   "(default: the bundled tiny-shakespeare)")
    tokenizer: str | None = _arg(None, "tokenizer folder or hub id (default: the model's)")
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer: prompts are token ids, outputs "
                                            "carry token ids and empty text")
    dtype: str = _arg("auto", "weights and activations dtype (auto: fp32 on CPU, the checkpoint's on GPU)",
                      choices=("auto", "float32", "float16", "bfloat16"))
    device: str = _arg("auto", "auto picks CUDA when a GPU is visible", choices=("auto", "cuda", "cpu"))
    seed: int = _arg(0, "seed of the global RNG (requests without their own seed)")
    block_size: int = _arg(16, "tokens per KV-cache block (a power of two)")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory for weights, activations and KV cache")
    num_gpu_blocks_override: int | None = _arg(None, "use exactly this many KV blocks, skipping the "
                                                     "memory profile (default: as many as fit)")
    swap_space: float = _arg(4.0, "GiB of CPU memory for swapped-out KV blocks")
    max_num_seqs: int = _arg(256, "most sequences in one step")
    max_num_batched_tokens: int | None = _arg(None, "most tokens in one step (default: "
                                                    "max(max_model_len, 2048); 512 with chunked prefill)")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's context length)")
    enable_prefix_caching: bool = _arg(False, "reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _arg(False, "split long prompts and mix them with decodes")
    preemption_mode: str | None = _arg(None, "force recompute or swap (default: vLLM v0's rule, "
                                             "recompute for one sequence, swap for several)",
                                       choices=("recompute", "swap"))
    scheduling_policy: str = _arg("fcfs", "fcfs, or priority (lower value first)", choices=("fcfs", "priority"))
    num_scheduler_steps: int | None = _arg(None, "decode steps per schedule (multi-step scheduling) (default: "
                                                 f"{DEFAULT_GPU_SCHEDULER_STEPS} on a GPU with CUDA graphs, without "
                                                 "pipeline stages or speculative decoding; else 1)")
    async_scheduling: bool | None = _arg(None, "schedule and queue the next multi-step run while the current "
                                               "run's last step computes (vLLM's async scheduling) (default: on "
                                               "with multi-step scheduling and no KV connector)")
    attention_backend: str | None = _arg(None, "torch (PyTorch reference) or triton (default: "
                                               "triton on a GPU, torch on a CPU)", choices=("torch", "triton"))
    enforce_eager: bool = _arg(False, "never use CUDA graphs")
    tensor_parallel_size: int = _arg(1, "ranks that split every layer (heads, MLP columns, vocabulary)", short="-tp")
    pipeline_parallel_size: int = _arg(1, "pipeline stages that split the stack of layers", short="-pp")
    distributed_executor_backend: str | None = _arg(
        None, "how workers run: uni (one process), mp (one process per rank on this machine), ray (Ray "
              "actors, on a Ray cluster) (default: uni for one rank, mp for more)", choices=("uni", "mp", "ray"))
    disable_custom_all_reduce: bool = _arg(False, "have NCCL do every all-reduce (default: on GPUs, small "
                                                  "tensor-parallel all-reduces go through symmetric memory)")
    speculative_model: str | None = _arg(None, "speculative decoding: a draft model (folder, hub id, or "
                                               "the bundled tiny-shakespeare-draft) or [ngram] for "
                                               "prompt lookup (default: no speculation)")
    num_speculative_tokens: int | None = _arg(None, "tokens the proposer guesses per step (needs "
                                                    "--speculative-model)")
    ngram_prompt_lookup_max: int | None = _arg(None, "[ngram]: longest suffix looked up in the sequence")
    ngram_prompt_lookup_min: int | None = _arg(None, "[ngram]: shortest suffix looked up (1 when not set)")
    kv_transfer_config: KVTransferConfig | None = _arg(
        None, 'a KV connector as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
              '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}\' (default: none)')
    scheduler_cls: str | type = _arg(DEFAULT_SCHEDULER_CLS, "the scheduler class, as module:Class (a subclass "
                                                             "of the mode's scheduler)")
    block_manager_cls: str | type = _arg(DEFAULT_BLOCK_MANAGER_CLS, "the block manager class the scheduler "
                                                                     "builds, as module:Class")
    worker_cls: str | type = _arg("auto", "the worker class, as module:Class (a subclass of the mode's "
                                          "worker; auto: the mode's)")
    enable_lora: bool = _arg(False, "serve LoRA adapters (a request names one with a LoRARequest)")
    max_loras: int = _arg(1, "LoRA: adapters on the GPU at once, the most distinct adapters in one batch")
    max_lora_rank: int = _arg(16, "LoRA: the largest adapter rank accepted")
    max_cpu_loras: int | None = _arg(None, "LoRA: adapters cached in CPU memory (default: max_loras)")

    def create_engine_config(self) -> EngineConfig:
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
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
        device_config = DeviceConfig(self.device)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,
            num_scheduler_steps=self._num_scheduler_steps(device_config),
            async_scheduling=self._async_scheduling(device_config),
            scheduler_cls=self.scheduler_cls,
            block_manager_cls=self.block_manager_cls,
        )
        speculative_config = SpeculativeConfig.maybe_create_spec_config(
            model_config, scheduler_config, self.speculative_model, self.num_speculative_tokens,
            self.ngram_prompt_lookup_max, self.ngram_prompt_lookup_min)
        if speculative_config is not None:  # slots for every round's guesses
            rounds = scheduler_config.num_scheduler_steps
            scheduler_config = dataclasses.replace(scheduler_config, num_lookahead_slots=speculative_config.num_lookahead_slots(rounds))
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=device_config,
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                           self.distributed_executor_backend, self.disable_custom_all_reduce,
                                           worker_cls=self.worker_cls),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            speculative_config=speculative_config,
            kv_transfer_config=self.kv_transfer_config,
            lora_config=self._lora_config(),
        )

    def _num_scheduler_steps(self, device_config: DeviceConfig) -> int:
        """The given value, else multi-step where nothing rules it out (the fast path by
        default; `enforce_eager=True` keeps the plain one-step loop for before-and-after)."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        fast_path = (device_config.device_type == "cuda" and not self.enforce_eager
                     and self.pipeline_parallel_size == 1
                     and self.speculative_model is None)
        return DEFAULT_GPU_SCHEDULER_STEPS if fast_path else 1

    def _async_scheduling(self, device_config: DeviceConfig) -> bool:
        """The given value, else on wherever multi-step runs (a KV connector's loads and saves,
        and speculation's next guesses, need the host between runs)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self._num_scheduler_steps(device_config) > 1 and not (self.kv_transfer_config or self.speculative_model)

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            if (self.max_loras, self.max_lora_rank, self.max_cpu_loras) != (1, 16, None):
                raise ValueError("max_loras, max_lora_rank and max_cpu_loras need enable_lora.")
            return None
        return LoRAConfig(max_lora_rank=self.max_lora_rank, max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras)

    # ------------------------------------------------------------------ command line
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per field (`max_num_seqs` -> `--max-num-seqs`), built from the
        field's type, default and `metadata` (help, choices). Help shows every default."""
        types = typing.get_type_hints(EngineArgs)
        group = parser.add_argument_group("engine arguments")
        for field in dataclasses.fields(EngineArgs):
            flags = ["--" + field.name.replace("_", "-"), *([field.metadata["short"]] if "short" in field.metadata else [])]
            help_text = field.metadata["help"]
            if field.default is not None:
                help_text += " (default: %(default)s)"
            elif "(default:" not in help_text:  # a None default is best explained in the help text
                help_text += " (default: not set)"
            arg_type = _cli_type(types[field.name])
            if arg_type is bool and field.default is None:  # on, off, or the engine decides
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif arg_type is bool:
                group.add_argument(*flags, action="store_true", help=help_text)
            else:
                # None is a default, never a choice: the flag's value is always a real one.
                group.add_argument(*flags, type=arg_type, default=field.default,
                                   choices=field.metadata.get("choices"), help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _cli_type(annotation) -> type:
    """`int | None` -> int: the type a flag's text converts to (an optional field's None is
    its default, never typed on the command line)."""
    # A class-valued field (`str | type`) takes its "module:Class" name on the command line.
    candidates = [t for t in typing.get_args(annotation) if t not in (type(None), type)] or [annotation]
    if len(candidates) == 1 and hasattr(candidates[0], "from_json"):  # a config given as JSON
        return candidates[0].from_json
    if len(candidates) != 1 or candidates[0] not in (str, int, float, bool):
        raise TypeError(f"no command-line type for {annotation!r}")
    return candidates[0]
