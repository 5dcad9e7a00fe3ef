"""The class-valued extension points a vLLM user knows: `scheduler_cls`, `worker_cls`, and the
scheduler's `block_manager_cls`, each given as a class or as "module:Class"."""

from __future__ import annotations

import argparse

import pytest

from minivllm import EngineArgs, LLM, SamplingParams
from minivllm.config import resolve_obj_by_qualname
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.core.scheduler import Scheduler
from minivllm.engine.async_scheduling import AsyncSchedulingLLMEngine
from minivllm.worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


class CountingScheduler(Scheduler):
    calls = 0

    def schedule(self):
        CountingScheduler.calls += 1
        return super().schedule()


class CountingBlockManager(BlockSpaceManager):
    allocations = 0

    def allocate(self, seq_group):
        CountingBlockManager.allocations += 1
        return super().allocate(seq_group)


class CountingWorker(Worker):
    steps = 0

    def execute_model(self, execute_model_req=None):
        CountingWorker.steps += 1
        return super().execute_model(execute_model_req)


def test_each_class_runs_inside_the_engine_with_the_same_output():
    plain = LLM(device="cpu").generate(["ROMEO:"], GREEDY)[0].outputs[0].token_ids
    llm = LLM(device="cpu", scheduler_cls=CountingScheduler, block_manager_cls=CountingBlockManager,
              worker_cls=CountingWorker)
    assert llm.generate(["ROMEO:"], GREEDY)[0].outputs[0].token_ids == plain
    engine = llm.llm_engine
    assert type(engine.scheduler) is CountingScheduler and CountingScheduler.calls >= 6
    assert type(engine.scheduler.block_manager) is CountingBlockManager and CountingBlockManager.allocations == 1
    assert type(engine.model_executor.driver_worker) is CountingWorker and CountingWorker.steps >= 6


def test_qualified_names_resolve_as_the_classes():
    assert resolve_obj_by_qualname("minivllm.core.scheduler:Scheduler") is Scheduler
    assert resolve_obj_by_qualname("minivllm.core.block_manager.BlockSpaceManager") is BlockSpaceManager
    llm = LLM(device="cpu", scheduler_cls=f"{__name__}:CountingScheduler", worker_cls="minivllm.worker.worker:Worker")
    assert type(llm.llm_engine.scheduler).__name__ == "CountingScheduler"


@pytest.mark.parametrize("kwargs, reason", [
    ({"scheduler_cls": CountingBlockManager}, "subclass of Scheduler"),
    ({"worker_cls": CountingScheduler}, "subclass of Worker"),
    ({"block_manager_cls": "minivllm.core.nowhere:Manager"}, "cannot import"),
])
def test_a_class_that_does_not_fit_is_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        LLM(device="cpu", **kwargs)


def test_a_mode_keeps_its_scheduler_and_refuses_one_that_lacks_it():
    assert AsyncSchedulingLLMEngine.mode_scheduler is AsyncScheduler
    engine = object.__new__(AsyncSchedulingLLMEngine)
    engine.scheduler_config = EngineArgs(device="cpu").create_engine_config().scheduler_config
    assert engine._scheduler_class() is AsyncScheduler  # the default name stands for the mode's own
    engine.scheduler_config.scheduler_cls = CountingScheduler
    with pytest.raises(ValueError, match="subclass of AsyncScheduler"):
        engine._scheduler_class()


def test_the_command_line_takes_class_names():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--scheduler-cls", "my_pkg:MyScheduler", "--worker-cls", "my_pkg:MyWorker"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.scheduler_cls, engine_args.worker_cls) == ("my_pkg:MyScheduler", "my_pkg:MyWorker")
    assert engine_args.block_manager_cls == "minivllm.core.block_manager.BlockSpaceManager"
