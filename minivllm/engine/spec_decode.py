"""Speculative decoding in the engine: `SpecDecodeLLMEngine`.

The worker (`minivllm.spec_decode.SpecDecodeWorker`) proposes `num_speculative_tokens` tokens per
sequence, scores them in one target-model pass and hands back one `SamplerOutput` per emitted
token position, processed as a multi-step run's (`MultiStepLLMEngine`). The first output of a
step is a `SpecDecodeSamplerOutput` carrying the acceptance counts so far, which go into the
step's `Stats.spec_decode_metrics`. Beam search is refused, as in vLLM.
"""

from __future__ import annotations

from minivllm.core.scheduler import ScheduledSequenceGroup
from minivllm.engine.metrics import Stats
from minivllm.engine.multi_step import MultiStepLLMEngine
from minivllm.sampling_params import InvalidParameterError, SamplingParams
from minivllm.sequence import SamplerOutput


class SpecDecodeLLMEngine(MultiStepLLMEngine):
    """`MultiStepLLMEngine` that records speculative decoding's acceptance counts."""

    def _finalize_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        if params.use_beam_search:
            raise InvalidParameterError("use_beam_search", "beam search cannot be combined with speculative "
                                        "decoding (as in vLLM): start the engine without speculative_model.")
        return super()._finalize_params(params, num_prompt_tokens)

    def _process_model_outputs(self, sampler_output: SamplerOutput, scheduled_groups: list[ScheduledSequenceGroup],
                               stats: Stats, is_first_step: bool) -> None:
        metrics = getattr(sampler_output, "spec_decode_worker_metrics", None)  # a SpecDecodeSamplerOutput's
        if metrics is not None:
            stats.spec_decode_metrics = metrics
        super()._process_model_outputs(sampler_output, scheduled_groups, stats, is_first_step)
