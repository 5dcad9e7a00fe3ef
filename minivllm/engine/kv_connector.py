"""A KV connector in the engine: `KVConnectorLLMEngine` (and its multi-step variant).

The engine builds the scheduler side of the connector (`KVConnectorFactory`, role SCHEDULER;
each worker builds its own worker side) and gives it to the `Scheduler`, which asks it at
admission how many tokens an outside store holds and sends each step's loads and saves to the
workers (`SchedulerOutputs.kv_connector_metadata`). Every output of a step that ran the
connector runner is a `KVTransferSamplerOutput` with the driver worker's cumulative counts:
they land in `Stats.kv_transfer_stats` and `engine.kv_transfer_stats` (None until the first).
"""

from __future__ import annotations

from minivllm.core.scheduler import ScheduledSequenceGroup, Scheduler
from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole, KVTransferStats
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import Stats
from minivllm.engine.multi_step import MultiStepLLMEngine
from minivllm.sequence import SamplerOutput


class KVConnectorLLMEngine(LLMEngine):
    """`LLMEngine` whose scheduler consults a KV connector."""

    kv_transfer_stats: KVTransferStats | None = None  # the driver worker's counts after the last step

    def _make_scheduler(self) -> Scheduler:
        self.kv_connector = KVConnectorFactory.create_connector(self.engine_config, KVConnectorRole.SCHEDULER)
        return self._scheduler_class()(self.scheduler_config, self.cache_config, self.engine_config.lora_config,
                                       kv_connector=self.kv_connector)

    def _process_model_outputs(self, sampler_output: SamplerOutput, scheduled_groups: list[ScheduledSequenceGroup],
                               stats: Stats, is_first_step: bool) -> None:
        transfer_stats = getattr(sampler_output, "kv_transfer_stats", None)  # a KVTransferSamplerOutput's
        if transfer_stats is not None:
            stats.kv_transfer_stats = self.kv_transfer_stats = transfer_stats
        super()._process_model_outputs(sampler_output, scheduled_groups, stats, is_first_step)


class MultiStepKVConnectorLLMEngine(KVConnectorLLMEngine, MultiStepLLMEngine):
    """A KV connector with multi-step runs (a step that loads or saves runs one model step)."""
