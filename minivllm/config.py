"""Engine configuration: one small dataclass per concern, as in `vllm/config.py` (v0).

No torch at import time: the scheduler (`minivllm.core`) reads `SchedulerConfig` and
`CacheConfig` in notebooks that load no model. `ModelConfig` reads the Hugging Face config
through transformers, and `DeviceConfig` asks torch for a GPU, only when they are built.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from minivllm.bundled_models import resolve_model

# Without chunked prefill a whole prompt must fit in one step, so the token budget is at
# least the context length; vLLM v0 uses at least this many for throughput.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# With chunked prefill vLLM v0 defaults to a small budget to keep decode latency low.
_DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS = 512
_SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
_GiB = 1 << 30
# How long to wait for the Hugging Face hub before saying it cannot be reached.
_HUB_CHECK_TIMEOUT_S = 3.0

logger = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    """Which checkpoint to load and how.

    `model=None` or `"tiny-shakespeare"` means the model bundled with minivllm; any other
    string is a local directory or a Hugging Face hub id. `hf_config` given (a
    transformers config built in code) means no checkpoint config is read: with
    `skip_tokenizer_init` (vLLM's name: prompts are token ids, outputs carry token ids and
    no text) an engine needs nothing from disk but its weights, and a stand-in executor
    (the simulator's) not even those.
    """

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
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
            _check_model_source(self.model, self.revision, "config.json")
            if self.tokenizer != self.model:
                _check_model_source(self.tokenizer, self.revision, "tokenizer_config.json")
            self.hf_config = _load_hf_config(self.model, self.revision)
        derived = _derive_max_model_len(self.hf_config)
        if self.max_model_len is None:
            self.max_model_len = derived
        elif not 0 < self.max_model_len <= derived:
            raise ValueError(
                f"max_model_len must be in [1, {derived}] (the model's context length), "
                f"got {self.max_model_len}."
            )

    # Shapes the cache engine needs: the whole model's, or one worker's share of it when a
    # `ParallelConfig` is given (vLLM's signatures).
    def get_num_layers(self, parallel_config: ParallelConfig | None = None) -> int:
        total = self.hf_config.num_hidden_layers
        if parallel_config is None:
            return total
        start, end = get_pp_indices(total, parallel_config.pp_rank, parallel_config.pipeline_parallel_size)
        return end - start

    def get_num_kv_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        """KV heads per rank; at least 1 (with more TP ranks than KV heads each rank keeps a
        replica of one head)."""
        cfg = self.hf_config
        total = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if parallel_config is None:
            return total
        return max(1, total // parallel_config.tensor_parallel_size)

    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        """ValueError unless the model splits into `parallel_config`'s shards (vLLM's check).

        Query heads and MLP columns split evenly over TP ranks; KV heads split evenly, or each
        is replicated over a whole number of ranks; every pipeline stage gets a layer."""
        cfg, tp, pp = self.hf_config, parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
        num_heads, num_kv_heads = cfg.num_attention_heads, self.get_num_kv_heads()
        if num_heads % tp:
            raise ValueError(f"the model's {num_heads} attention heads do not divide over "
                             f"tensor_parallel_size={tp} ranks.")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"the model's {num_kv_heads} KV heads neither divide over tensor_parallel_size={tp} "
                             f"ranks nor replicate evenly over them ({tp} must divide or be a multiple of "
                             f"{num_kv_heads}).")
        intermediate = getattr(cfg, "intermediate_size", 0)
        if intermediate % tp:
            raise ValueError(f"the model's intermediate_size {intermediate} does not divide over "
                             f"tensor_parallel_size={tp} ranks.")
        if cfg.num_hidden_layers < pp:
            raise ValueError(f"pipeline_parallel_size={pp} stages but only {cfg.num_hidden_layers} layers.")

    def load_tokenizer(self) -> Any:
        """transformers' AutoTokenizer, given the model's config when it is the model's tokenizer:
        else it reads config.json again, through the model type's slow-to-import class."""
        from transformers import AutoTokenizer  # deferred: keeps this module torch-free

        own = self.tokenizer == self.model
        return AutoTokenizer.from_pretrained(self.tokenizer, config=self.hf_config if own else None)

    def get_head_size(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


# The checkpoint fields minivllm's engine and models read whose defaults differ between
# transformers' config classes (and a rope field: rope_parameters, or 4.x's rope_theta).
_FIELDS_READ = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings")


def _load_hf_config(model: str, revision: str | None) -> Any:
    """The checkpoint's config.json as transformers' base `PretrainedConfig` (every field an
    attribute) when it sets every field minivllm reads; else `AutoConfig`, whose model-type
    class fills in its defaults. Timed, one INFO line per model: the model type's config
    module imports much of transformers' modeling code, seconds of start-up, so the base
    class is the fast path (docs/benchmarks.md, "Start-up").
    """
    start, num_modules = time.perf_counter(), len(sys.modules)
    from transformers import PretrainedConfig  # deferred: keeps this module torch-free

    config_dict, _ = PretrainedConfig.get_config_dict(model, revision=revision)
    missing = [f for f in _FIELDS_READ if f not in config_dict]
    missing += [] if {"rope_parameters", "rope_theta"} & config_dict.keys() else ["rope_theta"]
    if missing:
        from transformers import AutoConfig

        hf_config, source = AutoConfig.from_pretrained(model, revision=revision), "transformers' AutoConfig"
    else:
        hf_config, source = PretrainedConfig.from_dict(config_dict), "config.json"
    logger.info("model config: %s from %s in %.2f s (%d modules imported)%s", config_dict.get("model_type"),
                source, time.perf_counter() - start, len(sys.modules) - num_modules,
                f"; config.json leaves out {', '.join(missing)}" if missing else "")
    return hf_config


def _derive_max_model_len(hf_config: Any) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 2048))


def _check_model_source(model: str, revision: str | None, required_file: str) -> None:
    """Fail fast, with the reason, where transformers would fail late or obscurely.

    A missing folder would reach transformers as a hub id ("Repo id must be in the form ...",
    12 frames deep); a hub id with no network would be retried for ~25 s. A folder, a hub id
    in the local cache, or a hub id with the hub reachable passes; transformers does the rest.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if required_file == "config.json" and not (path / required_file).is_file():
            raise ValueError(f"model folder {model!r} has no config.json: give a Hugging Face checkpoint folder.")
        return
    if path.exists():
        raise ValueError(f"model {model!r} is a file: give the checkpoint's folder.")
    if _looks_like_a_path(model):
        raise ValueError(f"model {model!r}: no such folder. Give a checkpoint folder, a Hugging Face hub id "
                         "(such as 'Qwen/Qwen3-0.6B'), or nothing for the bundled tiny-shakespeare.")
    import huggingface_hub  # deferred: comes with transformers

    try:
        cached = huggingface_hub.try_to_load_from_cache(model, required_file, revision=revision)
    except ValueError as e:  # huggingface_hub's HFValidationError: not a valid repo id
        raise ValueError(f"model {model!r} is neither a folder nor a valid hub id: {e}") from e
    if isinstance(cached, str):
        return
    if _hub_offline():
        raise ValueError(f"model {model!r} is not a folder and not in the Hugging Face cache, and "
                         "HF_HUB_OFFLINE is set: download it first, or give a local folder.")
    if not _hub_reachable(huggingface_hub.constants.ENDPOINT):
        raise ValueError(f"model {model!r} is not a folder and not in the Hugging Face cache, and "
                         f"{huggingface_hub.constants.ENDPOINT} cannot be reached: check the name and "
                         "the network, or give a local folder.")


def _looks_like_a_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else with a slash is meant as a folder."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


def _hub_offline() -> bool:
    import huggingface_hub

    # The hub library reads HF_HUB_OFFLINE once, at import; it may have been set since.
    return huggingface_hub.constants.HF_HUB_OFFLINE or any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_reachable(endpoint: str) -> bool:
    """One TCP connect with a short timeout (a proxy, if set, is trusted to reach it)."""
    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=_HUB_CHECK_TIMEOUT_S).close()
    except OSError:
        return False
    return True



def resolve_obj_by_qualname(qualname: str | type) -> Any:
    """A class named by an extension point: the class itself, or "package.module:Name" /
    "package.module.Name" (vLLM's `resolve_obj_by_qualname`), the form other processes import."""
    if not isinstance(qualname, str):
        return qualname
    module_name, sep, name = qualname.partition(":")
    if not sep:
        module_name, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import {qualname!r}: {exc}") from exc


@dataclass
class CacheConfig:
    """The paged KV cache: block size, how much memory to use, and prefix caching.

    `num_gpu_blocks` and `num_cpu_blocks` are filled in by the worker's profile run
    (or by the user, for a model-free simulation).

    The arguments are vLLM 0.6.3's, in its order; `num_gpu_blocks` and `num_cpu_blocks`
    (attributes set later in vLLM) are keyword-only. What minivllm does not build must keep
    vLLM's default: `cache_dtype` "auto" (the model's dtype, no fp8 cache),
    `is_attention_free` False, `sliding_window` None, `cpu_offload_gb` 0.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    cache_dtype: str = "auto"
    is_attention_free: bool = False
    num_gpu_blocks_override: int | None = None
    sliding_window: int | None = None
    enable_prefix_caching: bool = False
    cpu_offload_gb: float = 0
    num_gpu_blocks: int | None = field(default=None, kw_only=True)
    num_cpu_blocks: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")
        if self.cache_dtype != "auto":
            raise ValueError(f"cache_dtype must be 'auto' (the model's dtype), got {self.cache_dtype!r}.")
        if self.is_attention_free is not False:
            raise ValueError(f"is_attention_free must be False: every model minivllm serves has attention, "
                             f"got {self.is_attention_free!r}.")
        if self.sliding_window is not None:
            raise ValueError(f"sliding_window must be None: minivllm has no sliding-window attention, "
                             f"got {self.sliding_window!r}.")
        if self.cpu_offload_gb != 0:
            raise ValueError(f"cpu_offload_gb must be 0: minivllm keeps every weight on the device, "
                             f"got {self.cpu_offload_gb!r}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}."
            )

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GiB)


# Names `SchedulerConfig.policy` accepts: the built-in two, plus those registered with
# `minivllm.core.policy.PolicyFactory.register` (which adds them here).
SCHEDULING_POLICIES = {"fcfs", "priority"}
DEFAULT_SCHEDULER_CLS = "minivllm.core.scheduler.Scheduler"
DEFAULT_BLOCK_MANAGER_CLS = "minivllm.core.block_manager.BlockSpaceManager"


@dataclass
class SchedulerConfig:
    """Budgets and policies of the scheduler.

    Args:
        max_num_batched_tokens: tokens per step (prompt chunks plus decode tokens).
        max_num_seqs: sequences per step.
        max_model_len: longest sequence (prompt plus output) the engine accepts.
        enable_chunked_prefill: mix decodes and prompt chunks in one step.
        preemption_mode: None (vLLM v0's rule), "recompute" or "swap".
        policy: "fcfs", "priority", or a name registered with `PolicyFactory.register`.
        num_scheduler_steps: decode steps the GPU runs per `schedule()` (vLLM v0's
            multi-step scheduling). Above 1, each decoding sequence gets slots reserved for
            its next `num_scheduler_steps` tokens, and a decode-only batch runs that many
            forward passes back to back, feeding each step's sampled tokens into the next on
            the GPU, so the host's scheduling and batch preparation are paid once per
            `num_scheduler_steps` tokens instead of once per token.
        num_lookahead_slots: slots a decoding sequence reserves beyond its next token: at
            least `num_scheduler_steps - 1` (multi-step), R * (k + 1) - 1 with speculation
            (k tokens, R = num_scheduler_steps rounds) (vLLM's field; `EngineArgs` sets it).
        async_scheduling: with multi-step, schedule the next run and queue it on the GPU
            while the current run's last step still computes (`AsyncScheduler.schedule_ahead`;
            vLLM v1's async scheduling), so the GPU does not wait for the host between runs.
        scheduler_cls: the scheduler class (vLLM's extension point): a subclass of the mode's
            scheduler, as a class or "module:Class".
        block_manager_cls: the block manager class the scheduler builds, with
            `BlockSpaceManager`'s constructor and public methods.
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str | None = None
    policy: str = "fcfs"
    num_scheduler_steps: int = 1
    num_lookahead_slots: int = 0
    async_scheduling: bool = False
    scheduler_cls: str | type = DEFAULT_SCHEDULER_CLS
    block_manager_cls: str | type = DEFAULT_BLOCK_MANAGER_CLS

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.async_scheduling and self.num_scheduler_steps == 1:
            raise ValueError("async_scheduling schedules the next multi-step run while the current one computes: "
                             "it needs num_scheduler_steps > 1.")
        if self.num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be at least 0, got {self.num_lookahead_slots}.")
        # A multi-step run of num_scheduler_steps decodes needs that many slots (vLLM: the max).
        self.num_lookahead_slots = max(self.num_lookahead_slots, self.num_scheduler_steps - 1)
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
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {sorted(SCHEDULING_POLICIES)}, got {self.policy!r} "
                             "(minivllm.core.policy.PolicyFactory.register adds one).")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")


@dataclass
class ParallelConfig:
    """How the model is split over workers (vLLM's `ParallelConfig`).

    Args:
        tensor_parallel_size: ranks that split every layer (heads, MLP columns, vocabulary).
        pipeline_parallel_size: stages that split the stack of layers.
        distributed_executor_backend: "mp" (one process per extra rank on this machine),
            "ray" (Ray actors, on one machine or a Ray cluster), "uni" (one process: world
            size 1 only), or None: "uni" for one rank, "mp" for more (vLLM's default on one
            node).
        disable_custom_all_reduce: have NCCL do every all-reduce (by default, on GPUs, the TP
            group's small bf16 all-reduces go through symmetric memory: `distributed/symm_mem.py`).
        rank: this worker's global rank. The engine's copy says 0; each worker gets a copy
            with its own (`dataclasses.replace`), never a shared config changed in place.
        worker_cls: "auto" (the mode's worker) or a subclass of it, as a class or "module:Class"
            (vLLM's extension point; a string when workers run in other processes).

    Ranks are laid out TP-major as in vLLM: rank = pp_rank * tensor_parallel_size + tp_rank,
    so the ranks of one pipeline stage are neighbours (on a GPU node: NVLink neighbours).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    disable_custom_all_reduce: bool = False
    rank: int = 0
    worker_cls: str | type = "auto"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise ValueError(f"disable_custom_all_reduce must be a bool, got {self.disable_custom_all_reduce!r}.")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS} "
                             f"or None, got {backend!r}.")
        if backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process, but the world size is "
                             f"{self.world_size}: use 'mp' or 'ray'.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step results the engine reads: TP rank 0 of the last stage, the
        one that holds the gathered logits and samples."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers that pipeline stage `pp_rank` runs: as even as possible,
    the first stages taking one more when the layers do not divide (vLLM's
    `vllm/distributed/utils.py`; here because the cache sizing in this module needs it).

    >>> [get_pp_indices(5, r, 2) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    base, extra = divmod(num_hidden_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


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
        if self.device_type == "cuda":
            _check_cuda_device(self.device)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


def _check_cuda_device(device: str) -> None:
    """`cuda` or `cuda:N` must name a GPU torch can use (else torch fails later, obscurely)."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device={device!r} but torch sees no GPU (torch {torch.__version__}, {build}): "
                         "use device='cpu' or 'auto'.")
    index = device.partition(":")[2]
    if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}.")


NGRAM_MODEL = "[ngram]"  # vLLM's `speculative_model` value for n-gram prompt lookup


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM 0.6's `SpeculativeConfig`: each step a proposer guesses
    `num_speculative_tokens` tokens per sequence, the target model scores them all in one
    forward pass, and a rejection sampler keeps a prefix of them (`minivllm/spec_decode/`).

    `draft_model_config` is the draft model's (None: n-gram prompt lookup, which proposes the
    tokens that followed the latest earlier occurrence of the sequence's last
    `ngram_prompt_lookup_max` ... `ngram_prompt_lookup_min` tokens). Build it with
    `maybe_create_spec_config`, which checks the combination against the target's configs.
    """

    num_speculative_tokens: int
    draft_model_config: ModelConfig | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        # An int, not 1.5 or "3": the count sizes tensors and slot tables inside the first step.
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer of at least 1, got {k!r}.")
        if self.draft_model_config is None:
            lo, hi = self.ngram_prompt_lookup_min, self.ngram_prompt_lookup_max
            if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (lo, hi)):
                raise ValueError(f"ngram_prompt_lookup_min/max must be integers, got min={lo!r}, max={hi!r}.")
            if hi is None:
                raise ValueError(f"speculative_model={NGRAM_MODEL!r} needs ngram_prompt_lookup_max (the longest "
                                 "suffix of the sequence to look up earlier in it, e.g. 4).")
            if lo is None or not 1 <= lo <= hi:
                raise ValueError("n-gram lookup needs 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, "
                                 f"got min={lo}, max={hi}.")

    @property
    def method(self) -> str:
        return "ngram" if self.draft_model_config is None else "draft_model"

    def num_lookahead_slots(self, num_rounds: int = 1) -> int:
        """Slots beyond a sequence's next token: one per guess, k + 1 per further round (multi-step)."""
        return num_rounds * (self.num_speculative_tokens + 1) - 1

    @staticmethod
    def maybe_create_spec_config(
        target_model_config: ModelConfig,
        target_scheduler_config: SchedulerConfig,
        speculative_model: str | None,
        num_speculative_tokens: int | None,
        ngram_prompt_lookup_max: int | None = None,
        ngram_prompt_lookup_min: int | None = None,
    ) -> SpeculativeConfig | None:
        """None when `speculative_model` is None; else the config, or a ValueError saying
        which combination cannot work (vLLM's checks, plus a vocabulary check)."""
        ngram_given = ngram_prompt_lookup_max is not None or ngram_prompt_lookup_min is not None
        if speculative_model is None:
            if num_speculative_tokens is not None or ngram_given:
                raise ValueError("num_speculative_tokens and ngram_prompt_lookup_* need speculative_model "
                                 f"(a draft model, or {NGRAM_MODEL!r}).")
            return None
        if num_speculative_tokens is None:
            raise ValueError("speculative_model needs num_speculative_tokens (tokens proposed per step).")
        if target_scheduler_config.enable_chunked_prefill:
            raise ValueError("speculative decoding and chunked prefill cannot be combined (as in vLLM 0.6).")
        if target_scheduler_config.async_scheduling:
            raise ValueError("speculative decoding cannot be combined with async_scheduling: the next round's "
                             "guesses need the host to have seen this round's tokens.")
        if speculative_model == NGRAM_MODEL:
            return SpeculativeConfig(num_speculative_tokens, None, ngram_prompt_lookup_max,
                                     1 if ngram_prompt_lookup_min is None else ngram_prompt_lookup_min)
        if ngram_given:
            raise ValueError(f"ngram_prompt_lookup_* apply to speculative_model={NGRAM_MODEL!r} only.")
        draft = ModelConfig(model=speculative_model, dtype=target_model_config.dtype,
                            seed=target_model_config.seed, max_model_len=None)
        if draft.max_model_len < target_model_config.max_model_len:
            raise ValueError(f"the draft model's context ({draft.max_model_len}) is shorter than "
                             f"max_model_len ({target_model_config.max_model_len}).")
        draft.max_model_len = target_model_config.max_model_len
        target_vocab = target_model_config.hf_config.vocab_size
        if draft.hf_config.vocab_size != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft.hf_config.vocab_size} tokens) differs from "
                             f"the target's ({target_vocab}): it must use the same tokenizer.")
        return SpeculativeConfig(num_speculative_tokens, draft)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """A KV connector: KV blocks saved to and loaded from a store outside the engine (vLLM's
    `KVTransferConfig`; `minivllm/distributed/kv_transfer/`).

    Args:
        kv_connector: a registered connector's name ("SharedStorageConnector",
            "CPUOffloadConnector", "RedisConnector", or one added by `register_connector`).
        kv_role: "kv_producer" saves the blocks it computes (a prefill instance),
            "kv_consumer" loads what the store has (a decode instance), "kv_both" does both.
        kv_connector_extra_config: the connector's own settings (a path, a URL, a capacity).

    From JSON (the `--kv-transfer-config` flag): `KVTransferConfig.from_json(text)`.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_connector must be a connector's name, got {self.kv_connector!r}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a dict, got "
                             f"{type(self.kv_connector_extra_config).__name__}.")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """'{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", ...}' -> the config."""
        import json

        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {error}") from error
        if not isinstance(fields, dict):
            raise ValueError(f"--kv-transfer-config must be a JSON object, got {text!r}.")
        unknown = set(fields) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(f"--kv-transfer-config has unknown fields {sorted(unknown)}.")
        if "kv_connector" not in fields:
            raise ValueError("--kv-transfer-config needs kv_connector (a connector's name).")
        return cls(**fields)


_LORA_EXTRA_VOCAB_SIZES = (0, 256, 512)


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's `LoRAConfig`; `minivllm/lora/`), vLLM 0.6.3's fields in its order.

    Args:
        max_lora_rank: the largest rank an adapter may have (every GPU slot is this wide).
        max_loras: adapters on the GPU at once, so at most this many distinct adapters in
            one batch (the scheduler keeps to it).
        fully_sharded_loras: must be False: column-parallel layers keep A whole on every
            TP rank (vLLM's default split; the fully sharded one is not built).
        max_cpu_loras: adapters kept loaded in CPU memory behind the GPU slots, least
            recently used out first (default: max_loras).
        lora_dtype: None or "auto": adapters run in the model's dtype.
        lora_extra_vocab_size: vLLM's room for tokens an adapter adds (0, 256 or 512); no
            minivllm adapter adds tokens (embedding adapters are refused), so it goes unused.
        long_lora_scaling_factors: must be None (no long-context LoRA).
    """

    max_lora_rank: int = 16
    max_loras: int = 1
    fully_sharded_loras: bool = False
    max_cpu_loras: int | None = None
    lora_dtype: str | None = None
    lora_extra_vocab_size: int = 256
    long_lora_scaling_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.fully_sharded_loras is not False:
            raise ValueError(f"fully_sharded_loras must be False: minivllm keeps A whole on every TP rank of a "
                             f"column-parallel layer, got {self.fully_sharded_loras!r}.")
        if self.lora_dtype not in (None, "auto"):
            raise ValueError(f"lora_dtype must be None or 'auto' (the model's dtype), got {self.lora_dtype!r}.")
        if self.lora_extra_vocab_size not in _LORA_EXTRA_VOCAB_SIZES:
            raise ValueError(f"lora_extra_vocab_size must be one of {_LORA_EXTRA_VOCAB_SIZES} (vLLM's values), "
                             f"got {self.lora_extra_vocab_size!r}.")
        if self.long_lora_scaling_factors is not None:
            raise ValueError("long_lora_scaling_factors must be None: minivllm has no long-context LoRA.")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}): every adapter on the GPU is also cached on the CPU.")


@dataclass
class EngineConfig:
    """All the configs of one engine, built once (by `EngineArgs.create_engine_config`) and
    passed down whole: engine -> executor -> worker -> model runner. vLLM keeps the same
    bundle in `vllm/config.py`.

    `attention_backend`: "torch", "triton" or None (the device's default, see
    `minivllm.attention.get_attn_backend`); attention, the fused layers and the greedy pick
    all follow it. `enforce_eager`: never capture CUDA graphs. `speculative_config`: None, or
    speculative decoding's proposer and number of proposed tokens.
    `kv_transfer_config`: None, or a KV connector (`KVTransferConfig`).
    `lora_config`: None, or multi-LoRA serving (`LoRAConfig`).
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig = field(default_factory=lambda: DeviceConfig("cpu"))
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: str | None = None
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None:
            self._check_kv_transfer()
        if self.lora_config is not None and (self.speculative_config or self.kv_transfer_config):
            # The draft model and the KV store's keys know nothing of adapters (vLLM 0.6 alike).
            raise ValueError("enable_lora cannot be combined with speculative decoding or a KV connector.")
        parallel = self.parallel_config
        if parallel.world_size == 1:
            return
        self.model_config.verify_with_parallel_config(parallel)
        if self.device_config.device_type == "cuda":
            import torch  # deferred: keeps this module torch-free

            if parallel.world_size > torch.cuda.device_count():
                raise ValueError(f"world size {parallel.world_size} (tensor_parallel_size x pipeline_parallel_size) "
                                 f"but this machine has {torch.cuda.device_count()} GPU(s): one rank per GPU.")
        if self.scheduler_config.num_scheduler_steps > 1 and parallel.pipeline_parallel_size > 1:
            raise ValueError("num_scheduler_steps > 1 (multi-step) works with tensor parallelism but not with "
                             "pipeline parallelism in minivllm; use num_scheduler_steps=1 with "
                             "pipeline_parallel_size > 1.")
        if self.speculative_config is not None:
            raise ValueError("speculative decoding runs on one worker only in minivllm (its SpecDecodeWorker "
                             "is the single-process executor's); use tensor and pipeline parallel sizes of 1.")

    def _check_kv_transfer(self) -> None:
        """A connector moves blocks inside the plain model runner's forward pass: the modes
        that replace that runner, or split the layers over stages, cannot carry it."""
        if self.speculative_config is not None:
            raise ValueError("kv_transfer_config cannot be combined with speculative decoding.")
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("kv_transfer_config needs pipeline_parallel_size=1 (tensor parallelism works: "
                             "each rank saves and loads its own shard).")
        if self.scheduler_config.async_scheduling:
            raise ValueError("kv_transfer_config cannot be combined with async_scheduling: a connector's loads "
                             "and saves need the host between runs.")
