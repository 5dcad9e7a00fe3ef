"""`LLMEngine.from_engine_args` picks the engine class once, by the configured mode
(`minivllm/engine/selector.py`), as vLLM picks `MultiStepWorker`; the plain engine knows no mode."""

import pytest

from minivllm.config import KVTransferConfig
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import Scheduler
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_scheduling import AsyncSchedulingLLMEngine
from minivllm.engine.kv_connector import KVConnectorLLMEngine, MultiStepKVConnectorLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.multi_step import MultiStepLLMEngine
from minivllm.engine.selector import engine_class
from minivllm.engine.spec_decode import SpecDecodeLLMEngine

NGRAM = {"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_max": 2}
STORE = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize("kwargs, expected", [
    ({}, LLMEngine),
    ({"num_scheduler_steps": 4, "async_scheduling": False}, MultiStepLLMEngine),
    ({"num_scheduler_steps": 4, "async_scheduling": True}, AsyncSchedulingLLMEngine),
    (NGRAM, SpecDecodeLLMEngine),
    ({"kv_transfer_config": "store"}, KVConnectorLLMEngine),
    ({"kv_transfer_config": "store", "num_scheduler_steps": 4}, MultiStepKVConnectorLLMEngine),
], ids=["plain", "multi-step", "async-scheduling", "speculative", "kv-connector", "kv-connector-multi-step"])
def test_each_mode_gets_its_engine_class(kwargs, expected, tmp_path):
    if kwargs.get("kv_transfer_config") == "store":
        extra = {"shared_storage_path": str(tmp_path)}
        kwargs = {**kwargs, "kv_transfer_config": KVTransferConfig(**STORE, kv_connector_extra_config=extra)}
    config = EngineArgs(device="cpu", **kwargs).create_engine_config()
    assert engine_class(config) is expected


def test_the_plain_engine_holds_no_mode_state():
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu"))
    assert type(engine) is LLMEngine and type(engine.scheduler) is Scheduler
    for mode_only in ("_scheduled_ahead", "kv_connector", "kv_transfer_stats", "_partial_outputs"):
        assert not hasattr(engine, mode_only), mode_only


def test_async_scheduling_gets_the_async_scheduler():
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", num_scheduler_steps=4, async_scheduling=True))
    assert isinstance(engine, AsyncSchedulingLLMEngine) and isinstance(engine.scheduler, AsyncScheduler)
    assert engine._scheduled_ahead is None


def test_a_mode_configuration_refuses_the_plain_engine_class():
    """The workers follow the configuration: a plain engine over multi-step workers would
    silently drop what the mode needs (here: the partial outputs between model steps)."""
    config = EngineArgs(device="cpu", num_scheduler_steps=4, async_scheduling=False).create_engine_config()
    with pytest.raises(ValueError, match="MultiStepLLMEngine"):
        LLMEngine(config)
