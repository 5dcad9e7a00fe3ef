"""Which worker and model runner serve an engine: every optional mode chosen here, once
(vLLM v0: `ParallelConfig.worker_cls` and `Worker.__init__`). A configured `worker_cls`
replaces the mode's worker and must subclass it.

    worker      Worker | MultiStepWorker | PipelineStageWorker | SpecDecodeWorker
                (+ KVConnectorWorkerMixin with a KV connector)
    runner      ModelRunner | CUDAGraphModelRunner | PipelineStageModelRunner
                (+ KVConnectorModelRunnerMixin, LoRAModelRunnerMixin as configured)
"""

from __future__ import annotations

import functools

import torch

from minivllm.attention.selector import get_attn_backend
from minivllm.config import EngineConfig, resolve_obj_by_qualname
from minivllm.kernels import supports_cuda_graphs
from minivllm.worker.cuda_graph_runner import CUDAGraphModelRunner
from minivllm.worker.kv_connector_model_runner import KVConnectorModelRunnerMixin, KVConnectorWorkerMixin
from minivllm.worker.lora_model_runner import LoRAModelRunnerMixin
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.pipeline_model_runner import PipelineStageModelRunner


def model_runner_class(engine_config: EngineConfig, device: torch.device) -> type[ModelRunner]:
    """The runner class of a worker on `device` (`Worker.__init__` builds it)."""
    backend = get_attn_backend(engine_config.attention_backend, device)
    if engine_config.parallel_config.pipeline_parallel_size > 1:
        base = PipelineStageModelRunner  # eager: a graph cannot hold the stages' send and receive
    elif device.type == "cuda" and not engine_config.enforce_eager and supports_cuda_graphs(backend):
        base = CUDAGraphModelRunner  # not with the reference ops: they sync with the host
    else:
        base = ModelRunner
    mixins = []
    if engine_config.kv_transfer_config is not None:  # loads and saves KV inside the forward
        mixins.append(KVConnectorModelRunnerMixin)
    if engine_config.lora_config is not None:  # adapters applied inside the projections
        mixins.append(LoRAModelRunnerMixin)
    return _compose(tuple(mixins), base)


def worker_class(engine_config: EngineConfig) -> type:
    """The class every rank's worker is built from (the executors call this)."""
    # Imported here: these subclass `Worker`, whose module imports this one for its runner.
    from minivllm.spec_decode.spec_decode_worker import SpecDecodeWorker
    from minivllm.worker.multi_step_worker import MultiStepWorker
    from minivllm.worker.pipeline_worker import PipelineStageWorker
    from minivllm.worker.worker import Worker

    if engine_config.speculative_config is not None:
        base = SpecDecodeWorker
    elif engine_config.scheduler_config.num_scheduler_steps > 1:
        base = MultiStepWorker
    elif engine_config.parallel_config.pipeline_parallel_size > 1:
        base = PipelineStageWorker
    else:
        base = Worker
    base = _configured_worker_class(engine_config.parallel_config.worker_cls, base)
    mixins = (KVConnectorWorkerMixin,) if engine_config.kv_transfer_config is not None else ()
    return _compose(mixins, base)


def _configured_worker_class(worker_cls: str | type, mode_worker: type) -> type:
    """`worker_cls` (vLLM's extension point): "auto" is the mode's worker, else a subclass of it."""
    if worker_cls == "auto":
        return mode_worker
    cls = resolve_obj_by_qualname(worker_cls)
    if not (isinstance(cls, type) and issubclass(cls, mode_worker)):
        raise ValueError(f"worker_cls must be a subclass of {mode_worker.__name__} for this configuration, "
                         f"got {cls!r}.")
    return cls


@functools.cache
def _compose(mixins: tuple[type, ...], base: type) -> type:
    """`base` with `mixins` in front, one class per combination ("LoRA" + "CUDAGraphModelRunner")."""
    if not mixins:
        return base
    prefix = "".join(mixin.__name__.removesuffix("Mixin").removesuffix("ModelRunner").removesuffix("Worker")
                     for mixin in mixins)
    return type(prefix + base.__name__, (*mixins, base), {"__module__": __name__})
