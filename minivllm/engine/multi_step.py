"""Runs of several model steps in the engine: `MultiStepLLMEngine`.

Mirrors `vllm/engine/output_processor/multi_step.py`. A multi-step run (`num_scheduler_steps`
> 1) and a speculative step hand back one `SamplerOutput` per model step, each as soon as it
reaches the host while the device computes the next; `LLMEngine._process_model_outputs`
applies them in turn. This class adds the streaming side: before applying a model step's
output it reports the last one's, for the scheduled requests still running, to `step`'s
`on_model_step` (`AsyncLLMEngine` and the MQ engine pass it), so a streaming client still sees
its tokens one at a time. The last model step's outputs are what `step` returns.
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.core.scheduler import ScheduledSequenceGroup
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import Stats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind
from minivllm.sequence import SamplerOutput

OnModelStep = Callable[[list[RequestOutput]], None]


class MultiStepLLMEngine(LLMEngine):
    """`LLMEngine` whose runs may hold several model steps, reported one at a time."""

    _on_model_step: OnModelStep | None = None  # the current `step`'s callback

    def step(self, on_model_step: OnModelStep | None = None) -> list[RequestOutput]:
        self._on_model_step = on_model_step
        try:
            return super().step(on_model_step)
        finally:
            self._on_model_step = None

    def _process_model_outputs(self, sampler_output: SamplerOutput, scheduled_groups: list[ScheduledSequenceGroup],
                               stats: Stats, is_first_step: bool) -> None:
        if not is_first_step and self._on_model_step is not None:  # another model step came: report the last
            self._on_model_step(self._partial_outputs(scheduled_groups))
        super()._process_model_outputs(sampler_output, scheduled_groups, stats, is_first_step)

    def _partial_outputs(self, scheduled_groups: list[ScheduledSequenceGroup]) -> list[RequestOutput]:
        """Outputs of the scheduled requests still running, in the middle of a run (finished
        ones are reported once, at the end of the step)."""
        decode = None if self.tokenizer is None else self.detokenizer.decode_token
        return [RequestOutput.from_seq_group(s.seq_group, decode, self.eos_token_id) for s in scheduled_groups
                if not s.seq_group.is_finished()
                and s.seq_group.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY]
