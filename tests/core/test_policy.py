"""Scheduling policies by name (`PolicyFactory.register`): the sort key orders admission."""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.policy import FCFS, Policy, PolicyFactory
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams


class LongestPromptFirst(Policy):
    def sort_key(self, seq_group):
        return (-len(seq_group.prompt_token_ids), seq_group.arrival_time)


def _finish_order(policy: str) -> list[str]:
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", scheduling_policy=policy, max_num_seqs=1,
                                                   num_gpu_blocks_override=32, max_model_len=128))
    for rid, n in (("short", 2), ("long", 9), ("middle", 5)):  # arrival order: short, long, middle
        engine.add_request(rid, {"prompt_token_ids": [20 + i for i in range(n)]},
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_a_registered_policy_orders_the_queue():
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="longest_first")
    PolicyFactory.register("longest_first", LongestPromptFirst)
    assert SchedulerConfig(policy="longest_first").policy == "longest_first"
    assert _finish_order("fcfs") == ["short", "long", "middle"]
    assert _finish_order("longest_first") == ["long", "middle", "short"]


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="Policy subclass"):
        PolicyFactory.register("x", object)
    with pytest.raises(ValueError, match="built-in"):
        PolicyFactory.register("fcfs", FCFS)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        PolicyFactory.get_policy("nope")
