"""Hooks for course tooling: a `StepObserver` watches the engine from outside, once per step.

No vLLM counterpart. `minivllm.viz`'s snapshot recorder and simulator are observers. The engine
keeps no state for them: they read it through public queries (the scheduler's queues, the
block manager's tables) at the two moments below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.core.scheduler import SchedulerOutputs
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.outputs import RequestOutput


class StepObserver:
    """Subclass it, override what you need and `engine.add_step_observer(observer)`."""

    def on_scheduled(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs) -> None:
        """After `schedule()`, before the model runs: the batch and the blocks as decided."""

    def on_step_end(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs,
                    request_outputs: list[RequestOutput]) -> None:
        """After the step's outputs are processed and finished requests' blocks freed."""


class StepObserverMixin:
    """`LLMEngine.add_step_observer` / `remove_step_observer` (its `step_observers` list)."""

    def add_step_observer(self, observer: StepObserver) -> None:
        self.step_observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.step_observers.remove(observer)
