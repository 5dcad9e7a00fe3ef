"""Which engine class serves a configuration: `engine_class`, read once by `from_engine_args`.

As vLLM picks `MultiStepWorker` over `Worker`, the engine of a mode is the plain `LLMEngine`
wrapped by that mode's subclass, each in a file of its own. The configuration rules out the
other combinations (`EngineConfig`: speculative decoding with async scheduling or a connector,
async scheduling with a connector or without multi-step).
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.engine.async_scheduling import AsyncSchedulingLLMEngine
from minivllm.engine.kv_connector import KVConnectorLLMEngine, MultiStepKVConnectorLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.multi_step import MultiStepLLMEngine
from minivllm.engine.spec_decode import SpecDecodeLLMEngine


def engine_class(engine_config: EngineConfig) -> type[LLMEngine]:
    multi_step = engine_config.scheduler_config.num_scheduler_steps > 1
    if engine_config.speculative_config is not None:
        return SpecDecodeLLMEngine
    if engine_config.kv_transfer_config is not None:
        return MultiStepKVConnectorLLMEngine if multi_step else KVConnectorLLMEngine
    if engine_config.scheduler_config.async_scheduling:
        return AsyncSchedulingLLMEngine
    return MultiStepLLMEngine if multi_step else LLMEngine
