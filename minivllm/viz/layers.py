"""The architecture's rules as plain data: layers, who may import whom, vLLM counterparts.

Read by the architecture map (`minivllm.viz.archmap`, which draws them) and by
`tests/test_architecture.py` (which checks the import graph against them). No drawing here,
and no import beyond the standard library.
"""

from __future__ import annotations

PACKAGE = "minivllm"
KERNELS_PACKAGE = "minivllm.kernels"

# ---------------------------------------------------------------------------------------------
# Layers, from the top of the stack down. A module belongs to the layer of its longest matching
# prefix ("minivllm.viz.style" is foundation, the rest of "minivllm.viz" is viz). `ROWS` places
# layers that do not depend on each other side by side (the scheduler beside the executor).
# A new top-level module or sub-package must be added here (tests/test_architecture.py says so).
LAYERS: dict[str, tuple[str, ...]] = {
    "package": ("minivllm",),  # the root __init__ only: `from minivllm import LLM`
    "entrypoints": ("minivllm.entrypoints", "minivllm.__main__"),
    "engine": ("minivllm.engine",),
    "viz": ("minivllm.viz",),
    "labs": ("minivllm.labs",),
    "core": ("minivllm.core",),
    "transformers_utils": ("minivllm.transformers_utils",),
    "executor": ("minivllm.executor",),
    "worker": ("minivllm.worker", "minivllm.spec_decode"),
    "model_executor": ("minivllm.model_executor", "minivllm.lora"),
    "kv_transfer": ("minivllm.distributed.kv_transfer",),
    "attention": ("minivllm.attention",),
    "kernels": ("minivllm.kernels",),
    "distributed": ("minivllm.distributed",),
    "foundation": (
        "minivllm.sequence",
        "minivllm.sampling_params",
        "minivllm.config",
        "minivllm.outputs",
        "minivllm.bundled_models",
        "minivllm.utils",
        "minivllm.logger",
        "minivllm.envs",
        "minivllm.plugins",
        "minivllm.viz.style",
        "minivllm.lora.request",  # plain data and file checks: the engine and the sequences use them
        "minivllm.lora.peft_helper",
    ),
}
ROWS: tuple[tuple[str, ...], ...] = (
    ("package", "entrypoints", "viz", "labs"),
    ("engine",),
    ("core", "transformers_utils", "executor"),
    ("worker",),
    ("model_executor", "kv_transfer"),
    ("attention",),
    ("kernels", "distributed"),
    ("foundation",),
)

# Each layer and the layers it may import (itself included). Read it bottom up: foundation
# (sequence, sampling_params, config, outputs, bundled_models, viz.style) is usable by all;
# the compute stack is kernels < attention < model_executor < worker < executor < engine <
# entrypoints, each importing any layer below it; the scheduler (core) sits beside that stack
# and knows nothing of it. viz (pictures, snapshots, the simulator, the exercises' checkers) is
# course tooling on top: it drives and observes the engine and its pieces (through `StepObserver`
# and public queries) and nothing in the runtime imports it. distributed (process groups, collectives) sits beside kernels:
# the parallel layers, the worker and the executors use it.
_STACK = ("kernels", "attention", "model_executor", "worker", "executor")
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "kernels": {"foundation", "kernels"},
    "distributed": {"foundation", "distributed"},
    "attention": {"foundation", *_STACK[:2]},
    "model_executor": {"foundation", "distributed", *_STACK[:3]},
    "worker": {"foundation", "distributed", *_STACK[:4]},
    "executor": {"foundation", "distributed", *_STACK[:5]},
    "core": {"foundation", "core"},
    "transformers_utils": {"foundation", "transformers_utils"},
    "engine": {"foundation", "distributed", *_STACK, "core", "transformers_utils", "engine"},
    "entrypoints": {"foundation", "distributed", *_STACK, "core", "transformers_utils", "engine", "entrypoints"},
    # The exercises' checkers run the real pieces (a cache engine, a rejection sampler, an LLM).
    "viz": {"foundation", "distributed", *_STACK, "core", "transformers_utils", "engine", "entrypoints",
            "package", "viz"},
    # The labs' checks run a learner's piece inside a real engine and compare with transformers.
    "labs": {"foundation", "distributed", *_STACK, "core", "transformers_utils", "engine", "entrypoints",
             "viz", "labs"},
    # The root __init__ re-exports the public API (LLM, SamplingParams, ...), never viz: a
    # plain `import minivllm` must not pull in matplotlib.
    "package": {"foundation", "distributed", *_STACK, "core", "transformers_utils", "engine", "entrypoints",
                "package"},
}
# The KV connectors (`minivllm.distributed.kv_transfer`) sit beside the compute stack: they move
# a worker's cache tensors but import none of the stack. The worker runs their worker side; the
# engine builds their scheduler side (the scheduler itself only calls the methods it is given).
MAY_IMPORT["kv_transfer"] = {"foundation", "kv_transfer"}
for _layer in ("worker", "executor", "engine", "entrypoints", "package", "viz", "labs"):
    MAY_IMPORT[_layer].add("kv_transfer")

# The layer map a newcomer reads first (notebook 00, `minivllm.viz.layermap`): what each layer
# holds, in a few words, and the calls that carry a request down the stack (caller, callee,
# the call). Every call is an import the source makes and `MAY_IMPORT` allows
# (tests/viz/test_layermap.py). Layers absent here (the root __init__) are left off the map.
LAYER_ROLES: dict[str, str] = {
    "entrypoints": "LLM.generate, the OpenAI server, the CLI",
    "viz": "pictures, snapshots, the simulator",
    "labs": "the labs' checks: your piece inside the real engine",
    "engine": "LLMEngine: add_request / step / abort",
    "core": "Scheduler, BlockSpaceManager (no torch)",
    "executor": "one call to every worker (uni, mp, Ray)",
    "worker": "Worker, CacheEngine, ModelRunner",
    "model_executor": "the Llama model, its layers, the Sampler",
    "kv_transfer": "KV connectors: the cache beyond an engine",
    "attention": "Attention: write the new K/V, then attend",
    "kernels": "PagedAttention: Triton + the PyTorch spec",
    "distributed": "process groups, all-reduce, send / recv",
    "foundation": "the data every layer shares: Sequence, SequenceGroup, SamplingParams, the configs, RequestOutput",
}
CALLS: tuple[tuple[str, str, str], ...] = (
    ("entrypoints", "engine", "add_request, step"),
    ("engine", "core", "schedule"),
    ("engine", "executor", "execute_model"),
    ("executor", "worker", "execute_model"),
    ("worker", "model_executor", "forward, sample"),
    ("worker", "kv_transfer", "load / save KV"),
    ("model_executor", "attention", "Attention.forward"),
    ("model_executor", "distributed", "all-reduce"),
    ("attention", "kernels", "paged attention ops"),
    ("viz", "engine", "observes"),
)

# The vLLM 0.6.3 file each minivllm module mirrors; paths are relative to vLLM's repo root
# (a folder ends in "/"). Every entry is checked: the key against minivllm's modules, the path
# against tests/data/vllm_0.6.3_files.txt (tests/viz/test_layers.py). The block manager
# follows v0's `BlockSpaceManagerV1` (dropped after 0.6.3). Modules with no counterpart (the
# simulator, the visualizations) are simply absent.
VLLM_PATHS: dict[str, str] = {
    "minivllm": "vllm/__init__.py",
    "minivllm.__main__": "vllm/scripts.py",
    "minivllm.sequence": "vllm/sequence.py",
    "minivllm.sampling_params": "vllm/sampling_params.py",
    "minivllm.config": "vllm/config.py",
    "minivllm.outputs": "vllm/outputs.py",
    "minivllm.plugins": "vllm/plugins/__init__.py",
    "minivllm.core": "vllm/core/",
    "minivllm.core.scheduler": "vllm/core/scheduler.py",
    "minivllm.core.block_manager": "vllm/core/block_manager_v1.py",
    "minivllm.core.block_allocator": "vllm/block.py",
    "minivllm.core.prefix_caching": "vllm/core/block/prefix_caching_block.py",
    "minivllm.core.priority_preemption": "vllm/core/scheduler.py",  # _schedule_priority_preemption
    "minivllm.core.lookahead": "vllm/core/scheduler.py",  # _get_num_lookahead_slots
    "minivllm.core.lora_slots": "vllm/core/scheduler.py",  # its curr_loras bookkeeping
    "minivllm.engine": "vllm/engine/",
    "minivllm.engine.llm_engine": "vllm/engine/llm_engine.py",
    "minivllm.engine.async_llm_engine": "vllm/engine/async_llm_engine.py",
    "minivllm.engine.protocol": "vllm/engine/protocol.py",
    "minivllm.engine.multiprocessing": "vllm/engine/multiprocessing/__init__.py",
    "minivllm.engine.multiprocessing.engine": "vllm/engine/multiprocessing/engine.py",
    "minivllm.engine.multiprocessing.client": "vllm/engine/multiprocessing/client.py",
    "minivllm.engine.arg_utils": "vllm/engine/arg_utils.py",
    "minivllm.engine.metrics": "vllm/engine/metrics.py",
    "minivllm.engine.output_processor": "vllm/engine/output_processor/single_step.py",
    "minivllm.engine.detokenizer": "vllm/transformers_utils/detokenizer.py",
    "minivllm.engine.stream_detokenizer": "vllm/transformers_utils/detokenizer.py",  # its role; the form is V1's
    "minivllm.engine.input_preprocess": "vllm/inputs/preprocess.py",
    "minivllm.engine.beam_search": "vllm/engine/output_processor/single_step.py",  # its beam branch
    "minivllm.engine.prompt_logprobs": "vllm/engine/output_processor/single_step.py",  # process_prompt_logprob
    "minivllm.engine.multi_step": "vllm/engine/output_processor/multi_step.py",
    "minivllm.engine.profiler": "vllm/engine/llm_engine.py",  # start_profile / stop_profile
    "minivllm.engine.lora_adapters": "vllm/engine/llm_engine.py",  # add_lora / remove_lora / list_loras
    "minivllm.executor": "vllm/executor/",
    "minivllm.executor.executor_base": "vllm/executor/executor_base.py",
    "minivllm.executor.uniproc_executor": "vllm/executor/gpu_executor.py",
    "minivllm.executor.distributed_executor": "vllm/executor/distributed_gpu_executor.py",
    "minivllm.executor.multiproc_executor": "vllm/executor/multiproc_gpu_executor.py",
    "minivllm.executor.multiproc_worker_utils": "vllm/executor/multiproc_worker_utils.py",
    "minivllm.executor.metadata_delta": "vllm/sequence.py",
    "minivllm.executor.ray_executor": "vllm/executor/ray_gpu_executor.py",
    "minivllm.executor.ray_utils": "vllm/executor/ray_utils.py",
    "minivllm.executor.virtual_engine": "vllm/executor/ray_gpu_executor.py",  # its pp_locks / virtual_engine calls
    "minivllm.engine.pipeline_parallel_engine": "vllm/engine/async_llm_engine.py",  # engine_step per virtual engine
    "minivllm.distributed": "vllm/distributed/",
    "minivllm.distributed.parallel_state": "vllm/distributed/parallel_state.py",
    "minivllm.distributed.communication_op": "vllm/distributed/communication_op.py",
    "minivllm.distributed.utils": "vllm/distributed/utils.py",
    "minivllm.distributed.symm_mem": "vllm/distributed/device_communicators/custom_all_reduce.py",
    "minivllm.model_executor.layers.linear": "vllm/model_executor/layers/linear.py",
    "minivllm.model_executor.layers.vocab_parallel_embedding": (
        "vllm/model_executor/layers/vocab_parallel_embedding.py"
    ),
    "minivllm.model_executor.models.utils": "vllm/model_executor/models/utils.py",
    "minivllm.model_executor.weight_utils": "vllm/model_executor/model_loader/weight_utils.py",
    "minivllm.worker": "vllm/worker/",
    "minivllm.worker.worker": "vllm/worker/worker.py",
    "minivllm.worker.cache_engine": "vllm/worker/cache_engine.py",
    "minivllm.worker.model_runner": "vllm/worker/model_runner.py",
    "minivllm.worker.worker_profiler": "vllm/worker/worker.py",  # start_profile / stop_profile
    "minivllm.worker.virtual_engine": "vllm/worker/worker.py",  # cache_engine[virtual_engine]
    "minivllm.worker.cuda_graph_runner": "vllm/worker/model_runner.py",  # CUDAGraphRunner
    "minivllm.worker.lora_model_runner": "vllm/worker/model_runner.py",  # its LoRA parts
    "minivllm.worker.pipeline_model_runner": "vllm/worker/model_runner.py",  # its pipeline parts
    "minivllm.worker.pipeline_worker": "vllm/worker/worker_base.py",  # IntermediateTensors sent / received
    "minivllm.worker.multi_step_worker": "vllm/worker/multi_step_worker.py",
    "minivllm.worker.multi_step_model_runner": "vllm/worker/multi_step_model_runner.py",
    "minivllm.lora": "vllm/lora/",
    "minivllm.lora.request": "vllm/lora/request.py",
    "minivllm.lora.peft_helper": "vllm/lora/models.py",
    "minivllm.lora.layers": "vllm/lora/layers.py",
    "minivllm.lora.models": "vllm/lora/models.py",
    "minivllm.lora.punica_wrapper": "vllm/lora/punica.py",
    "minivllm.lora.worker_manager": "vllm/lora/worker_manager.py",
    "minivllm.model_executor": "vllm/model_executor/",
    "minivllm.model_executor.sampling_metadata": "vllm/model_executor/sampling_metadata.py",
    "minivllm.model_executor.token_stats": "vllm/model_executor/sampling_metadata.py",  # SamplingTensors' token lists
    "minivllm.model_executor.custom_op": "vllm/model_executor/custom_op.py",
    "minivllm.model_executor.layers": "vllm/model_executor/layers/",
    "minivllm.model_executor.model_loader": "vllm/model_executor/model_loader/loader.py",
    "minivllm.model_executor.layers.layernorm": "vllm/model_executor/layers/layernorm.py",
    "minivllm.model_executor.layers.rotary_embedding": (
        "vllm/model_executor/layers/rotary_embedding.py"
    ),
    "minivllm.model_executor.layers.activation": "vllm/model_executor/layers/activation.py",
    "minivllm.model_executor.layers.sampler": "vllm/model_executor/layers/sampler.py",
    "minivllm.model_executor.layers.parallel_sampling": "vllm/model_executor/layers/sampler.py",
    "minivllm.model_executor.layers.device_sampler": "vllm/model_executor/layers/sampler.py",  # _sample
    "minivllm.model_executor.layers.sampling_ops": "vllm/model_executor/layers/sampler.py",  # top-k/p, penalties
    "minivllm.model_executor.layers.logprobs": "vllm/model_executor/layers/sampler.py",  # _get_logprobs
    "minivllm.model_executor.layers.logits_processor": "vllm/model_executor/layers/logits_processor.py",
    "minivllm.model_executor.layers.rejection_sampler": "vllm/model_executor/layers/rejection_sampler.py",
    "minivllm.spec_decode": "vllm/spec_decode/",
    "minivllm.spec_decode.spec_decode_worker": "vllm/spec_decode/spec_decode_worker.py",
    "minivllm.spec_decode.draft_model_worker": "vllm/spec_decode/multi_step_worker.py",
    "minivllm.spec_decode.ngram_worker": "vllm/spec_decode/ngram_worker.py",
    "minivllm.spec_decode.metrics": "vllm/spec_decode/metrics.py",
    "minivllm.spec_decode.util": "vllm/spec_decode/util.py",
    "minivllm.model_executor.models": "vllm/model_executor/models/registry.py",
    "minivllm.model_executor.models.llama": "vllm/model_executor/models/llama.py",
    "minivllm.attention": "vllm/attention/",
    "minivllm.attention.layer": "vllm/attention/layer.py",
    "minivllm.attention.selector": "vllm/attention/selector.py",
    "minivllm.attention.metadata": "vllm/attention/backends/abstract.py",
    "minivllm.kernels": "vllm/_custom_ops.py",
    "minivllm.kernels.reference": "tests/kernels/test_attention.py",  # its ref_* functions
    "minivllm.kernels.paged_attention": "csrc/attention/attention_kernels.cu",
    "minivllm.kernels.prefill_attention": "vllm/attention/ops/prefix_prefill.py",
    "minivllm.kernels.reshape_and_cache": "csrc/cache_kernels.cu",
    "minivllm.kernels.cache_ops": "csrc/cache_kernels.cu",
    "minivllm.kernels.lora_reference": "vllm/lora/ops/sgmv_shrink.py",
    "minivllm.kernels.lora_ops": "vllm/lora/ops/sgmv_expand.py",
    "minivllm.kernels.fused_ops": "csrc/layernorm_kernels.cu",  # + activation_kernels.cu, pos_encoding_kernels.cu
    "minivllm.kernels.sampling": "vllm/model_executor/layers/sampler.py",  # its top-k/p and the draw, fused
    "minivllm.entrypoints": "vllm/entrypoints/",
    "minivllm.entrypoints.llm": "vllm/entrypoints/llm.py",
    "minivllm.entrypoints.cli": "vllm/scripts.py",
    "minivllm.entrypoints.openai": "vllm/entrypoints/openai/",
    "minivllm.entrypoints.openai.api_server": "vllm/entrypoints/openai/api_server.py",
    "minivllm.entrypoints.openai.cli_args": "vllm/entrypoints/openai/cli_args.py",
    "minivllm.entrypoints.openai.protocol": "vllm/entrypoints/openai/protocol.py",
    "minivllm.entrypoints.openai.serving_engine": "vllm/entrypoints/openai/serving_engine.py",
    "minivllm.entrypoints.openai.metrics": "vllm/engine/metrics.py",
    "minivllm.entrypoints.openai.serving_chat": "vllm/entrypoints/openai/serving_chat.py",
    "minivllm.entrypoints.openai.serving_completion": (
        "vllm/entrypoints/openai/serving_completion.py"
    ),
}

def layer_of(module: str) -> str | None:
    """The layer of `module` by its longest matching prefix in `LAYERS`; None if unlisted."""
    match = _longest_prefix(module)
    return match[0] if match else None


def _longest_prefix(module: str) -> tuple[str, str] | None:
    """(layer, prefix) of the longest `LAYERS` prefix that `module` is or lies under."""
    matches = [
        (layer, prefix)
        for layer, prefixes in LAYERS.items()
        for prefix in prefixes
        # The root prefix "minivllm" names the root __init__ only, or it would match everything.
        if module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))
    ]
    return max(matches, key=lambda match: len(match[1])) if matches else None


def vllm_path(module: str) -> str | None:
    """The vLLM file (or folder) that `module` mirrors, or None if it has no counterpart."""
    return VLLM_PATHS.get(module)
