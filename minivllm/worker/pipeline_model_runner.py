"""One pipeline stage's runner: `PipelineStageModelRunner`.

Mirrors the pipeline parts of `vllm/worker/model_runner.py` (v0), in a file of its own;
`selector.py` picks it when `pipeline_parallel_size` > 1 (always eager: a CUDA graph would
not hold the stage's send and receive). A stage runs its own layers:

    first stage    input_ids                        -> IntermediateTensors
    middle stage   IntermediateTensors (received)   -> IntermediateTensors
    last stage     IntermediateTensors (received)   -> logits -> SamplerOutput

IntermediateTensors: {"hidden_states", "residual"}, each `[num_tokens, hidden]`. The
worker moves them between stages (`pipeline_worker.py`).
"""

from __future__ import annotations

import torch

from minivllm.model_executor.models.utils import IntermediateTensors
from minivllm.sequence import SamplerOutput, SequenceGroupMetadata
from minivllm.worker.model_runner import ModelRunner

# What one stage hands the next (the model's names).
_STAGE_TENSORS = ("hidden_states", "residual")


class PipelineStageModelRunner(ModelRunner):
    """A `ModelRunner` for one stage: takes the previous stage's tensors, and returns its own
    for the next stage unless it is the last."""

    @torch.inference_mode()
    def execute_model(self, seq_group_metadata_list: list[SequenceGroupMetadata], kv_caches: list[torch.Tensor],
                      finished_requests_ids: list[str] | None = None,
                      intermediate_tensors: IntermediateTensors | None = None) -> SamplerOutput | IntermediateTensors:
        """One step of this stage: the last stage's `SamplerOutput`, another's tensors for the next."""
        self.release_requests(finished_requests_ids or [])
        if not seq_group_metadata_list:
            return SamplerOutput([])
        model_input = self.prepare_model_input(seq_group_metadata_list)
        output = self.model(model_input.input_ids, model_input.positions, kv_caches, model_input.attn_metadata,
                            intermediate_tensors)
        if isinstance(output, IntermediateTensors):  # a stage before the last
            return output
        return self.sample(output, model_input.sampling_metadata)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The plain profile; a stage after the first starts from zeros shaped like what the
        previous stage would send."""
        batch = self.profile_batch()
        num_tokens = sum(metadata.token_chunk_size for metadata in batch)
        previous = None if self.engine_config.parallel_config.pp_rank == 0 else self._zeros_from_previous(num_tokens)
        self.execute_model(batch, self.empty_kv_caches(), intermediate_tensors=previous)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _zeros_from_previous(self, num_tokens: int) -> IntermediateTensors:
        shape = (num_tokens, self.model_config.hf_config.hidden_size)
        return IntermediateTensors({name: torch.zeros(shape, dtype=self.dtype, device=self.device)
                                    for name in _STAGE_TENSORS})
