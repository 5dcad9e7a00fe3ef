"""The runner side of multi-LoRA: `LoRAModelRunnerMixin`.

Mirrors the LoRA parts of `vllm/worker/model_runner.py` (v0), which keeps them in
`vllm/lora/worker_manager.py`; `selector.py` mixes this over the runner the engine uses
(eager, CUDA graphs or a pipeline stage). Per step, after the batch is flattened:

    token_lora_ids   [num_tokens]   each new token's adapter id (0: the base model)
    set_active_adapters             this step's adapters into GPU slots, a slot per token
"""

from __future__ import annotations

from minivllm.lora.worker_manager import LRUCacheWorkerLoRAManager
from minivllm.sequence import SequenceGroupMetadata


class LoRAModelRunnerMixin:
    """Over a `ModelRunner`: the adapters' caches and slots (`lora_manager`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lora_manager: LRUCacheWorkerLoRAManager | None = None  # built with the model

    def load_model(self) -> None:
        """Load the base model, then replace its projections with their LoRA versions."""
        super().load_model()
        scheduler_config = self.scheduler_config
        # The most rows a forward pass may have: a prefill batch, or every sequence's decode
        # token and its lookahead slots.
        max_num_tokens = max(scheduler_config.max_num_batched_tokens,
                             scheduler_config.max_num_seqs * (1 + scheduler_config.num_lookahead_slots))
        self.lora_manager = LRUCacheWorkerLoRAManager(self.model, self.engine_config.lora_config,
                                                      self.model_config.hf_config, max_num_tokens, self.backend)

    def prepare_model_input(self, seq_group_metadata_list: list[SequenceGroupMetadata]):
        model_input = super().prepare_model_input(seq_group_metadata_list)
        self.lora_manager.set_active_adapters(seq_group_metadata_list, token_lora_ids(seq_group_metadata_list))
        return model_input


def token_lora_ids(seq_group_metadata_list: list[SequenceGroupMetadata]) -> list[int]:
    """Each new token's adapter id (0: the base model), in batch order."""
    return [metadata.lora_int_id
            for metadata in seq_group_metadata_list
            for _ in metadata.seq_data
            for _ in range(metadata.token_chunk_size if metadata.is_prompt else 1)]
