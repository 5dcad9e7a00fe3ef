"""Turn a scheduled batch into tensors, run the model, sample: `ModelRunner`.

Mirrors `vllm/worker/model_runner.py` (v0). The scheduler hands over a list of
`SequenceGroupMetadata`, prefills first; the model wants one flat stream of tokens.
`prepare_model_input` flattens it (the attention layer splits the batch where the decodes
start):

    seq:           A (prefill, 3 cached + 4 new)   B (decode)   C (decode)
    input_ids      a3 a4 a5 a6                     b9           c5
    positions      3  4  5  6                      9            5
    slot_mapping   one cache slot per token (`attention.metadata.slot_of`)
    seq_lens       7                               10           6       (context + new)
    query_start_loc 0                  4            5            6      (cumulative new)

Then `execute_model` runs the model over all tokens, keeps the hidden states of the rows
that need logits (`SamplingMetadata`), and samples: one `SamplerOutput` per step.

This is the plain, eager, one-step runner. The optional modes wrap it, each in a file of
its own (vLLM's pattern): `cuda_graph_runner.py` replays decode steps from captured CUDA
graphs; `multi_step_model_runner.py` runs several decode steps per schedule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minivllm.attention import AttentionMetadata, build_attn_metadata, get_attn_backend
from minivllm.attention.metadata import to_device
from minivllm.config import EngineConfig
from minivllm.model_executor import get_model
from minivllm.model_executor.layers.sampler import Sampler
from minivllm.model_executor.models.utils import IntermediateTensors
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SamplerOutput, SequenceData, SequenceGroupMetadata

logger = logging.getLogger(__name__)

# Placeholder block of the profile run's sequences (it runs before the cache exists).
_PROFILE_BLOCK = 0


@dataclass
class ModelInput:
    """One flattened batch, ready for the model.

    Attributes:
        input_ids: `[num_tokens]` int64.
        positions: `[num_tokens]` int64, each token's position in its sequence.
        attn_metadata: slot_mapping, seq_lens, query_start_loc, block_tables, ...
        sampling_metadata: which rows get logits and how each request samples.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_metadata: SamplingMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class ModelRunner:
    """Builds batches, runs the model, samples.

    Args:
        engine_config: the engine's configs (model, cache, scheduler, attention backend).
        device: where to run (default: the device config's).
    """

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
        # request_id -> seeded generator, kept across steps (see SamplingMetadata.prepare).
        self.generators: dict[str, torch.Generator] = {}
        # With enable_lora: the adapters' caches and slots (`minivllm/lora/worker_manager.py`).
        self.lora_manager = None

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, attn_backend=self.backend)
        self.dtype = next(self.model.parameters()).dtype
        lora_config = self.engine_config.lora_config
        if lora_config is not None:  # replaces the projections with their LoRA versions
            from minivllm.lora.worker_manager import LRUCacheWorkerLoRAManager

            max_num_tokens = max(self.scheduler_config.max_num_batched_tokens,
                                 self.scheduler_config.max_num_seqs * (1 + self.scheduler_config.num_lookahead_slots))
            self.lora_manager = LRUCacheWorkerLoRAManager(self.model, lora_config, self.model_config.hf_config,
                                                          max_num_tokens, self.backend)

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
        sampling_metadata = SamplingMetadata.prepare(
            seq_group_metadata_list, group_query_lens, self.device, self.generators)
        if self.lora_manager is not None:  # this step's adapters into GPU slots, a slot per token
            self.lora_manager.set_active_adapters(seq_group_metadata_list, _token_lora_ids(seq_group_metadata_list))
        return ModelInput(
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.long), self.device),
            positions=to_device(torch.tensor(positions, dtype=torch.long), self.device),
            attn_metadata=attn_metadata,
            sampling_metadata=sampling_metadata,
        )

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute_model(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        kv_caches: list[torch.Tensor],
        finished_requests_ids: list[str] | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> SamplerOutput | IntermediateTensors:
        """One step: the sampler's output for each group, in the order given.

        Split over ranks: a pipeline stage before the last returns the `IntermediateTensors`
        for the next stage (and a later stage takes them in); a tensor-parallel rank other
        than 0 returns an empty output (rank 0 gathered the logits and sampled).
        """
        self.release_requests(finished_requests_ids or [])
        if not seq_group_metadata_list:
            return SamplerOutput([])
        model_input = self.prepare_model_input(seq_group_metadata_list)
        hidden_states = self.run_model(model_input.input_ids, model_input.positions,
                                       model_input.attn_metadata, kv_caches, intermediate_tensors)
        if isinstance(hidden_states, IntermediateTensors):
            return hidden_states
        selected = hidden_states[model_input.sampling_metadata.selected_token_indices]
        logits = self.model.compute_logits(selected)
        if logits is None:
            return SamplerOutput([])
        return self.sampler(logits, model_input.sampling_metadata)

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                  kv_caches: list[torch.Tensor],
                  intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """The forward pass: `[num_tokens]` ids and positions -> `[num_tokens, hidden]`
        (or, on a pipeline stage before the last, the tensors for the next stage)."""
        if intermediate_tensors is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def release_requests(self, finished_requests_ids: list[str]) -> None:
        """Forget per-request state (seeded generators, penalty statistics) of requests that ended."""
        for request_id in finished_requests_ids:
            self.generators.pop(request_id, None)
        self.sampler.device_sampler.release(finished_requests_ids)

    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """Prepare for serving once the KV cache exists. Nothing to do when running eagerly;
        `CUDAGraphModelRunner` captures its graphs here."""

    # ------------------------------------------------------------------ profiling
    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest batch the scheduler may send, with no KV cache, to find peak memory.

        `max_num_batched_tokens` prompt tokens spread over `max_num_seqs` sequences (each at
        most `max_model_len`), every one sampled, so the activations, the logits rows and the
        sampler's temporaries all reach their maximum.
        """
        max_tokens = self.scheduler_config.max_num_batched_tokens
        max_model_len = self.scheduler_config.max_model_len
        num_seqs = max(min(self.scheduler_config.max_num_seqs, max_tokens), -(-max_tokens // max_model_len))
        lengths = [max_tokens // num_seqs + (i < max_tokens % num_seqs) for i in range(num_seqs)]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        metadata_list = []
        for i, length in enumerate(lengths):
            data = SequenceData([0] * length)
            metadata_list.append(SequenceGroupMetadata(
                str(i), True, {i: data}, params, {i: [_PROFILE_BLOCK] * -(-length // self.block_size)}, length
            ))
        parallel_config = self.engine_config.parallel_config
        empty_caches = [torch.empty(0, device=self.device)
                        for _ in range(self.model_config.get_num_layers(parallel_config))]
        self.execute_model(metadata_list, empty_caches, intermediate_tensors=self._dummy_intermediate(max_tokens))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _dummy_intermediate(self, num_tokens: int) -> IntermediateTensors | None:
        """A later pipeline stage's profile input (what the previous stage would send)."""
        if self.engine_config.parallel_config.pp_rank == 0:
            return None
        shape = (num_tokens, self.model_config.hf_config.hidden_size)
        return IntermediateTensors({name: torch.zeros(shape, dtype=self.dtype, device=self.device)
                                    for name in ("hidden_states", "residual")})


def _token_lora_ids(seq_group_metadata_list: list[SequenceGroupMetadata]) -> list[int]:
    """Each new token's adapter id (0: the base model), in batch order; built only with LoRA on."""
    return [metadata.lora_int_id
            for metadata in seq_group_metadata_list
            for _ in metadata.seq_data
            for _ in range(metadata.token_chunk_size if metadata.is_prompt else 1)]
