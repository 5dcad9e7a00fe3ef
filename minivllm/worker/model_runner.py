"""Turn a scheduled batch into tensors, run the model, sample (vLLM's
`vllm/worker/model_runner.py`, v0). `prepare_model_input` flattens the scheduler's
`SequenceGroupMetadata` list, prefills first, into one stream of tokens:

    seq:           A (prefill, 3 cached + 4 new)   B (decode)   C (decode)
    input_ids      a3 a4 a5 a6                     b9           c5
    positions      3  4  5  6                      9            5
    slot_mapping   one cache slot per token (`attention.metadata.slot_of`)
    seq_lens       7                               10           6       (context + new)
    query_start_loc 0                  4            5            6      (cumulative new)

`execute_model` runs the model over all tokens and samples the rows that need logits.
The optional modes extend this plain runner from files of their own (`selector.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.attention import AttentionMetadata, build_attn_metadata, get_attn_backend
from minivllm.attention.metadata import to_device
from minivllm.config import EngineConfig
from minivllm.model_executor import get_model
from minivllm.model_executor.layers.sampler import Sampler
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SamplerOutput, SequenceData, SequenceGroupMetadata

# Placeholder block of the profile run's sequences (it runs before the cache exists).
_PROFILE_BLOCK = 0


@dataclass
class ModelInput:
    """One flattened batch: input_ids and positions `[num_tokens]` int64, the attention
    metadata, and the sampling metadata (which rows get logits, how each request samples)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_metadata: SamplingMetadata


class ModelRunner:
    """Builds batches, runs the model, samples; on `device` (default: the device config's)."""

    def __init__(self, engine_config: EngineConfig, device: torch.device | str | None = None) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.scheduler_config = engine_config.scheduler_config
        self.device = torch.device(device or engine_config.device_config.device)
        self.block_size = engine_config.cache_config.block_size
        # "torch" or "triton": attention, the fused layers and the greedy pick all follow it.
        self.backend = get_attn_backend(engine_config.attention_backend, self.device)
        self.model: torch.nn.Module | None = None
        self.sampler = Sampler(self.backend)

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, attn_backend=self.backend)
        self.dtype = next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ batch building
    def prepare_model_input(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> ModelInput:
        """Flatten the scheduled groups (prefills first, as the scheduler orders them)."""
        input_ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        seq_query_lens: list[int] = []
        num_prefills = 0
        for metadata in seq_group_metadata_list:
            for seq_id, data in metadata.seq_data.items():
                if metadata.is_prompt:
                    # A prefill resumes after its computed tokens (cached prefix, earlier chunks).
                    start = data.num_computed_tokens
                    tokens = data.get_token_ids()[start : start + metadata.token_chunk_size]
                    num_prefills += 1
                else:  # a decode computes exactly its last token
                    start, tokens = data.get_len() - 1, [data.get_last_token_id()]
                input_ids.extend(tokens)
                positions.extend(range(start, start + len(tokens)))
                tables.append(metadata.block_tables[seq_id])
                context_lens.append(start)
                seq_query_lens.append(len(tokens))
        attn_metadata = build_attn_metadata(tables, context_lens, seq_query_lens, num_prefills,
                                            self.block_size, self.device)
        # Every sequence of a group computes as many tokens (the group's chunk, or 1).
        group_query_lens = [m.token_chunk_size if m.is_prompt else 1 for m in seq_group_metadata_list]
        sampling_metadata = SamplingMetadata.prepare(seq_group_metadata_list, group_query_lens, self.device)
        return ModelInput(
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.long), self.device),
            positions=to_device(torch.tensor(positions, dtype=torch.long), self.device),
            attn_metadata=attn_metadata,
            sampling_metadata=sampling_metadata,
        )

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute_model(self, seq_group_metadata_list: list[SequenceGroupMetadata], kv_caches: list[torch.Tensor],
                      finished_requests_ids: list[str] | None = None) -> SamplerOutput:
        """One step: the sampler's output for each group, in the order given."""
        self.release_requests(finished_requests_ids or [])
        if not seq_group_metadata_list:
            return SamplerOutput([])
        model_input = self.prepare_model_input(seq_group_metadata_list)
        hidden_states = self.run_model(model_input.input_ids, model_input.positions, model_input.attn_metadata,
                                       kv_caches)
        return self.sample(hidden_states, model_input.sampling_metadata)

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                  kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The forward pass: `[num_tokens]` ids and positions -> `[num_tokens, hidden]`."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def sample(self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """Logits `[num_selected, vocab]` for the rows that need them, then the sampler (a
        tensor-parallel rank other than 0 gets no logits: nothing to sample)."""
        logits = self.model.compute_logits(hidden_states[sampling_metadata.selected_token_indices])
        if logits is None:
            return SamplerOutput([])
        return self.sampler(logits, sampling_metadata)

    def release_requests(self, finished_requests_ids: list[str]) -> None:
        """Forget the penalty statistics of requests that ended."""
        self.sampler.device_sampler.release(finished_requests_ids)

    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """Once the KV cache exists: nothing when eager; `CUDAGraphModelRunner` captures here."""

    # ------------------------------------------------------------------ profiling
    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest batch the scheduler may send, with no KV cache, to find peak memory."""
        self.execute_model(self.profile_batch(), self.empty_kv_caches())
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def profile_batch(self) -> list[SequenceGroupMetadata]:
        """`max_num_batched_tokens` prompt tokens over `max_num_seqs` sequences (each at most
        `max_model_len`), all sampled: activations, logits and sampler temporaries at their peak."""
        max_tokens = self.scheduler_config.max_num_batched_tokens
        max_model_len = self.scheduler_config.max_model_len
        num_seqs = max(min(self.scheduler_config.max_num_seqs, max_tokens), -(-max_tokens // max_model_len))
        lengths = [max_tokens // num_seqs + (i < max_tokens % num_seqs) for i in range(num_seqs)]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        return [SequenceGroupMetadata(str(i), True, {i: SequenceData([0] * length)}, params,
                                      {i: [_PROFILE_BLOCK] * -(-length // self.block_size)}, length)
                for i, length in enumerate(lengths)]

    def empty_kv_caches(self) -> list[torch.Tensor]:
        """One empty tensor per layer: the profile runs before the cache exists."""
        num_layers = self.model_config.get_num_layers(self.engine_config.parallel_config)
        return [torch.empty(0, device=self.device) for _ in range(num_layers)]
