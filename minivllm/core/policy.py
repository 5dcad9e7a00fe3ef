"""Scheduling policies: the order in which the scheduler serves its queues (vLLM v0's
`vllm/core/policy.py`: `Policy`, `FCFS`, `PolicyFactory`).

A policy is a sort key over `SequenceGroup`s; lower goes first. The scheduler sorts its
waiting and swapped queues by it every step and preempts from the back of its running queue,
so the key decides who is admitted first and who is preempted first. Two are built in,
"fcfs" (arrival order) and "priority" (the request's `priority`, then arrival; the scheduler
also preempts lower-priority running requests for it). Add one by name:

    class ShortestPromptFirst(Policy):
        def sort_key(self, seq_group):
            return (len(seq_group.prompt_token_ids), seq_group.arrival_time)

    PolicyFactory.register("spf", ShortestPromptFirst)
    LLM(scheduling_policy="spf")
"""

from __future__ import annotations

from minivllm.config import SCHEDULING_POLICIES
from minivllm.sequence import SequenceGroup


class Policy:
    """Orders sequence groups: `sort_key(seq_group)`, lower first."""

    def sort_key(self, seq_group: SequenceGroup) -> tuple:
        raise NotImplementedError


class FCFS(Policy):
    def sort_key(self, seq_group: SequenceGroup) -> tuple:
        return (seq_group.arrival_time,)


class PriorityPolicy(Policy):
    def sort_key(self, seq_group: SequenceGroup) -> tuple:
        return (seq_group.priority, seq_group.arrival_time)


class PolicyFactory:
    _POLICY_REGISTRY: dict[str, type[Policy]] = {"fcfs": FCFS, "priority": PriorityPolicy}

    @classmethod
    def register(cls, name: str, policy_class: type[Policy]) -> None:
        """Make `SchedulerConfig(policy=name)` valid and order the queues with `policy_class`."""
        if not (isinstance(policy_class, type) and issubclass(policy_class, Policy)):
            raise ValueError(f"policy_class must be a Policy subclass, got {policy_class!r}.")
        if name in ("fcfs", "priority"):
            raise ValueError(f"{name!r} is a built-in policy; choose another name.")
        cls._POLICY_REGISTRY[name] = policy_class
        SCHEDULING_POLICIES.add(name)  # the config's check reads this set

    @classmethod
    def get_policy(cls, name: str) -> Policy:
        if name not in cls._POLICY_REGISTRY:
            raise ValueError(f"unknown scheduling policy {name!r}; registered: {sorted(cls._POLICY_REGISTRY)}.")
        return cls._POLICY_REGISTRY[name]()
