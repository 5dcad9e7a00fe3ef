"""Turn a scheduled batch into tensors, run the model, sample: `ModelRunner`.

Mirrors `vllm/worker/model_runner.py` (v0). The scheduler hands over a list of
`SequenceGroupMetadata`; the model wants one flat stream of tokens. `prepare_model_input`
flattens, prefills first and decodes after (the attention layer splits the batch there):

    seq:           A (prefill, 3 cached + 4 new)   B (decode)   C (decode)
    input_ids      a3 a4 a5 a6                     b9           c5
    positions      3  4  5  6                      9            5
    slot_mapping   one cache slot per token: block_table[pos // block_size] * block_size
                   + pos % block_size
    seq_lens       7                               10           6       (context + new)
    query_start_loc 0                  4            5            6      (cumulative new)

Then `execute_model` runs the model over all tokens, keeps the hidden states of the rows
that need logits (`SamplingMetadata`), and samples.

Multi-step (`execute_model_multi_step`, vLLM v0's multi-step scheduling): a decode batch
runs several forward passes back to back. Between two of them nothing goes back to the
host: `_advance_step` turns each row's sampled token into the next step's input on the GPU
(position + 1, sequence length + 1, the slot from the block table the scheduler already
grew by its lookahead slots). The host reads every step's tokens once, at the end, so the
scheduling, batch building and output processing around the GPU are paid once per run.

CUDA graphs (GPU, unless `enforce_eager=True`): a decode step runs dozens of small kernels
per layer, and for a small batch the time to *launch* them rivals the time to run them.
A captured graph replays the whole forward pass with one launch. Graphs freeze shapes and
addresses, so we capture one graph per padded batch size and copy each step's inputs into
static buffers. Only decode batches are captured: their shapes depend on the batch size
alone (one token per sequence, block tables of a fixed width), whereas a prefill's token
count changes every step, and a prefill is compute-bound anyway (big matmuls hide the
launch cost).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention import AttentionMetadata
from minivllm.config import CacheConfig, ModelConfig, SchedulerConfig
from minivllm.model_executor import get_model
from minivllm.model_executor.layers.sampler import Sampler
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceData, SequenceGroupMetadata, SequenceGroupOutput, SequenceOutput

logger = logging.getLogger(__name__)

# Decode batch sizes with a captured CUDA graph (a batch is padded up to the next one):
# dense where small batches are common, then every 16 (nano-vllm and vLLM do the same).
_SMALL_GRAPH_BATCH_SIZES = (1, 2, 4, 8)
_GRAPH_BATCH_SIZE_STEP = 16
# Padding rows of a graph batch write nowhere and attend to one token of block 0.
_PAD_SLOT = -1
_PAD_BLOCK = 0


@dataclass
class ModelInput:
    """One flattened batch, ready for the model.

    Attributes:
        input_ids: `[num_tokens]` int64.
        positions: `[num_tokens]` int64, each token's position in its sequence.
        attn_metadata: slot_mapping, seq_lens, query_start_loc, block_tables, ...
        sampling_metadata: which rows get logits and how each request samples.
        query_lens: new tokens per group (as scheduled), in batch order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_metadata: SamplingMetadata
    query_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class ModelRunner:
    """Builds batches, runs the model (eagerly or through CUDA graphs), samples."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device | str,
        attn_backend: str | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = torch.device(device)
        self.block_size = cache_config.block_size
        self.attn_backend = attn_backend
        self.enforce_eager = enforce_eager or self.device.type != "cuda"
        self.model: torch.nn.Module | None = None
        self.sampler = Sampler()
        # request_id -> seeded generator, kept across steps (see SamplingMetadata.prepare).
        self.generators: dict[str, torch.Generator] = {}
        self.graph_runners: dict[int, _CUDAGraphRunner] = {}

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, attn_backend=self.attn_backend)
        self.dtype = next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ batch building
    def prepare_model_input(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> ModelInput:
        """Flatten the scheduled groups (prefills must come first) into one batch."""
        _check_prefills_first(seq_group_metadata_list)
        datas: list[SequenceData] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        query_lens: list[int] = []  # per group (all sequences of a group compute as many)
        seq_query_lens: list[int] = []  # per sequence
        num_prefills = 0
        for metadata in seq_group_metadata_list:
            query_len = metadata.token_chunk_size if metadata.is_prompt else 1
            query_lens.append(query_len)
            for seq_id, data in metadata.seq_data.items():
                # A prefill resumes after its computed tokens (cached prefix, earlier chunks);
                # a decode computes exactly the last token.
                datas.append(data)
                tables.append(metadata.block_tables[seq_id])
                context_lens.append(data.num_computed_tokens if metadata.is_prompt else data.get_len() - 1)
                seq_query_lens.append(query_len)
                num_prefills += metadata.is_prompt
        block_tables = _pad_block_tables(tables)
        context = np.array(context_lens, dtype=np.int64)
        queries = np.array(seq_query_lens, dtype=np.int64)
        input_ids, positions = _flatten_tokens(datas, context, queries, num_prefills)
        # Row of each new token's sequence, for a vectorized block-table lookup.
        rows = np.repeat(np.arange(len(datas)), queries)
        logical_blocks = positions // self.block_size
        if np.any(logical_blocks >= np.array([len(t) for t in tables])[rows]):
            raise ValueError("a block table holds fewer blocks than its sequence's new tokens need.")
        slot_mapping = block_tables[rows, logical_blocks].astype(np.int64) * self.block_size + positions % self.block_size
        attn_metadata = self._attn_metadata(context, queries, num_prefills, slot_mapping, block_tables)
        sampling_metadata = SamplingMetadata.prepare(
            seq_group_metadata_list, query_lens, self.device, self.generators
        )
        return ModelInput(
            input_ids=_to_device(input_ids, torch.long, self.device),
            positions=_to_device(positions, torch.long, self.device),
            attn_metadata=attn_metadata,
            sampling_metadata=sampling_metadata,
            query_lens=query_lens,
        )

    def _attn_metadata(self, context_lens: np.ndarray, query_lens: np.ndarray, num_prefills: int,
                       slot_mapping: np.ndarray, block_tables: np.ndarray) -> AttentionMetadata:
        seq_lens = context_lens + query_lens
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
        return AttentionMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=int(query_lens[:num_prefills].sum()),
            num_decode_tokens=len(query_lens) - num_prefills,
            slot_mapping=_to_device(slot_mapping, torch.long, self.device),
            seq_lens=_to_device(seq_lens, torch.int32, self.device),
            query_start_loc=_to_device(query_start_loc, torch.int32, self.device),
            block_tables=_to_device(block_tables, torch.int32, self.device),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute_model(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        kv_caches: list[torch.Tensor],
        finished_requests_ids: list[str] | None = None,
    ) -> list[SequenceGroupOutput]:
        """One step: the sampler's output for each group, in the order given."""
        for request_id in finished_requests_ids or []:
            self.generators.pop(request_id, None)
        if not seq_group_metadata_list:
            return []
        # Prefills first, as the attention layer expects; remember the caller's order.
        order = sorted(range(len(seq_group_metadata_list)), key=lambda i: not seq_group_metadata_list[i].is_prompt)
        model_input = self.prepare_model_input([seq_group_metadata_list[i] for i in order])
        hidden_states = self._run_model(model_input.input_ids, model_input.positions,
                                        model_input.attn_metadata, kv_caches)
        selected = hidden_states[model_input.sampling_metadata.selected_token_indices]
        logits = self.model.compute_logits(selected)
        sorted_outputs = self.sampler(logits, model_input.sampling_metadata)
        outputs: list[SequenceGroupOutput | None] = [None] * len(order)
        for position, output in zip(order, sorted_outputs):
            outputs[position] = output
        return outputs

    def can_run_multi_step(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> bool:
        """A multi-step run needs decodes only, each one plain sequence the sampler can
        serve on the device (no logprobs, penalties, seeds, beams or forks)."""
        return bool(seq_group_metadata_list) and all(
            not m.is_prompt and self.sampler.samples_on_device(m.sampling_params, list(m.seq_data.values()))
            for m in seq_group_metadata_list
        )

    @torch.inference_mode()
    def execute_model_multi_step(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        kv_caches: list[torch.Tensor],
        num_steps: int,
        finished_requests_ids: list[str] | None = None,
        output_callback: Callable[[list[SequenceGroupOutput]], None] | None = None,
    ) -> list[list[SequenceGroupOutput]]:
        """Up to `num_steps` decode steps with no host sync between them; one output list per step.

        Group i runs `1 + num_lookahead_slots` steps (the slots its blocks hold); in later
        steps its row keeps computing but writes no K/V, and its output has no samples.
        Each step's tokens are copied to the host as soon as they exist; `output_callback`
        gets step s's outputs once step s + 1 is queued on the GPU, so the caller processes
        them while the GPU computes. Requires `can_run_multi_step`.
        """
        for request_id in finished_requests_ids or []:
            self.generators.pop(request_id, None)
        model_input = self.prepare_model_input(seq_group_metadata_list)
        steps_allowed = [1 + m.num_lookahead_slots for m in seq_group_metadata_list]
        limits = _to_device(np.array(steps_allowed), torch.long, self.device)
        input_ids, positions, md = model_input.input_ids, model_input.positions, model_input.attn_metadata
        all_outputs: list[list[SequenceGroupOutput]] = []
        pending = None  # the previous step's samples on their way to the host
        for step in range(num_steps):
            if step:
                input_ids, positions, md = self._advance_step(input_ids, positions, md, limits > step)
            hidden_states = self._run_model(input_ids, positions, md, kv_caches)
            # A decode samples every row; the sampler upcasts what it needs in fp32.
            logits = self.model.compute_logits(hidden_states, upcast=False)
            # The sampled tokens, still on the device, are the next step's input ids.
            input_ids, logprobs = self.sampler.sample_on_device(logits, model_input.sampling_metadata)
            if pending is not None:  # step - 1 is done once step is queued: hand it over
                all_outputs.append(self._step_outputs(pending, step - 1, seq_group_metadata_list, steps_allowed))
                if output_callback is not None:
                    output_callback(all_outputs[-1])
            pending = _copy_to_host(input_ids, logprobs)
        all_outputs.append(self._step_outputs(pending, num_steps - 1, seq_group_metadata_list, steps_allowed))
        if output_callback is not None:
            output_callback(all_outputs[-1])
        return all_outputs

    @staticmethod
    def _step_outputs(pending, step: int, seq_group_metadata_list: list[SequenceGroupMetadata],
                      steps_allowed: list[int]) -> list[SequenceGroupOutput]:
        """One output per group: its sampled token, or none past its reserved slots."""
        tokens, logprobs, ready = pending
        if ready is not None:
            ready.synchronize()  # this step's copy only, not the steps queued after it
        outputs = []
        for metadata, allowed, token, logprob in zip(seq_group_metadata_list, steps_allowed,
                                                      tokens.tolist(), logprobs.tolist()):
            [seq_id] = metadata.seq_data
            samples = [SequenceOutput(seq_id, token, {token: logprob})] if step < allowed else []
            outputs.append(SequenceGroupOutput(samples=samples))
        return outputs

    def _advance_step(self, sampled: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                      active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The next decode step's inputs, computed on the device (vLLM's `advance_step`).

        sampled, positions, active: `[num_seqs]`. An active row feeds its sampled token at
        the next position and writes its K/V to that position's slot. A row out of reserved
        slots stays where it is and writes nothing (its later tokens are dropped).
        """
        moved = active.long()
        positions = positions + moved
        seq_lens = md.seq_lens + moved.to(md.seq_lens.dtype)
        rows = torch.arange(positions.shape[0], device=positions.device)
        blocks = md.block_tables[rows, positions // self.block_size].long()
        slot_mapping = torch.where(active, blocks * self.block_size + positions % self.block_size, _PAD_SLOT)
        md = dataclasses.replace(md, slot_mapping=slot_mapping, seq_lens=seq_lens, max_seq_len=md.max_seq_len + 1)
        return sampled, positions, md

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                   kv_caches: list[torch.Tensor]) -> torch.Tensor:
        batch_size = md.num_decode_tokens
        # A decode-only batch replays the graph of the smallest captured size that holds it.
        if md.num_prefills == 0 and batch_size <= max(self.graph_runners, default=0):
            runner = self.graph_runners[min(s for s in self.graph_runners if s >= batch_size)]
            return runner.replay(input_ids, positions, md)
        return self.model(input_ids, positions, kv_caches, md)

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
                str(i), True, {i: data}, params, {i: [_PAD_BLOCK] * -(-length // self.block_size)}, length
            ))
        empty_caches = [torch.empty(0, device=self.device) for _ in range(self.model_config.get_num_layers())]
        self.execute_model(metadata_list, empty_caches)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture one decode graph per batch size in `graph_batch_sizes()` (GPU only)."""
        if self.enforce_eager:
            return
        sizes = self.graph_batch_sizes()
        max_blocks = -(-self.scheduler_config.max_model_len // self.block_size)
        buffers = _GraphBuffers(max(sizes), max_blocks, self.device)
        pool = None
        # Largest first: later (smaller) graphs reuse the first one's memory pool.
        for batch_size in reversed(sizes):
            runner = _CUDAGraphRunner(self.model, kv_caches, buffers, batch_size, self.scheduler_config.max_model_len)
            pool = runner.capture(pool)
            self.graph_runners[batch_size] = runner
        logger.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def graph_batch_sizes(self) -> list[int]:
        limit = self.scheduler_config.max_num_seqs
        sizes = [s for s in _SMALL_GRAPH_BATCH_SIZES if s <= limit]
        sizes += list(range(_GRAPH_BATCH_SIZE_STEP, limit + 1, _GRAPH_BATCH_SIZE_STEP))
        if sizes[-1] < limit:
            sizes.append(limit)
        return sizes


class _GraphBuffers:
    """Static input tensors shared by every captured graph (a graph reads fixed addresses)."""

    def __init__(self, max_batch_size: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch_size,), _PAD_SLOT, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_batch_size, max_blocks), _PAD_BLOCK, dtype=torch.int32, device=device)


class _CUDAGraphRunner:
    """One captured decode forward pass for a fixed batch size."""

    def __init__(self, model, kv_caches, buffers: _GraphBuffers, batch_size: int, max_seq_len: int) -> None:
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.batch_size = batch_size
        b = batch_size
        self.attn_metadata = AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
            slot_mapping=buffers.slot_mapping[:b], seq_lens=buffers.seq_lens[:b],
            query_start_loc=buffers.query_start_loc[: b + 1], block_tables=buffers.block_tables[:b],
            max_query_len=1, max_seq_len=max_seq_len,
        )
        self.graph = torch.cuda.CUDAGraph()
        self.output: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        b = self.batch_size
        return self.model(self.buffers.input_ids[:b], self.buffers.positions[:b], self.kv_caches, self.attn_metadata)

    def capture(self, pool):
        self._forward()  # warm-up: compiles the Triton kernels outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = self._forward()
        torch.cuda.synchronize()
        return self.graph.pool()

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        n, buffers = input_ids.shape[0], self.buffers
        b = self.batch_size
        buffers.input_ids[:n].copy_(input_ids)
        buffers.positions[:n].copy_(positions)
        buffers.slot_mapping[:n].copy_(md.slot_mapping)
        buffers.slot_mapping[n:b].fill_(_PAD_SLOT)
        buffers.seq_lens[:n].copy_(md.seq_lens)
        buffers.seq_lens[n:b].fill_(1)
        width = md.block_tables.shape[1]
        buffers.block_tables[:n, :width].copy_(md.block_tables)
        buffers.block_tables[n:b].fill_(_PAD_BLOCK)
        self.graph.replay()
        return self.output[:n]


def _pad_block_tables(tables: list[list[int]]) -> np.ndarray:
    """`[num_seqs, max_blocks]` int32; rows padded with block 0 (kernels stop at seq_len)."""
    lengths = np.array([len(t) for t in tables])
    block_tables = np.zeros((len(tables), lengths.max()), dtype=np.int32)
    # One scatter of all block numbers (row-major order) instead of a numpy call per row.
    block_tables[np.arange(lengths.max()) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    return block_tables


def _flatten_tokens(datas: list[SequenceData], context_lens: np.ndarray, query_lens: np.ndarray,
                    num_prefills: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and positions of every new token: prefill chunks, then one token per decode."""
    prefill_ids = [
        data.get_token_ids()[start : start + length]
        for data, start, length in zip(datas[:num_prefills], context_lens.tolist(), query_lens.tolist())
    ]
    decode_ids = [data.get_last_token_id() for data in datas[num_prefills:]]
    input_ids = np.fromiter((t for ids in prefill_ids for t in ids), dtype=np.int64)
    input_ids = np.concatenate([input_ids, np.array(decode_ids, dtype=np.int64)])
    # Position of each new token: its sequence's context length plus its offset in the chunk.
    starts = np.repeat(context_lens, query_lens)
    offsets = np.arange(int(query_lens.sum())) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    return input_ids, starts + offsets


def _copy_to_host(tokens: torch.Tensor, logprobs: torch.Tensor):
    """(tokens, logprobs, event): host copies started without waiting; wait on the event."""
    if tokens.device.type != "cuda":
        return tokens, logprobs, None
    host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
    host_tokens.copy_(tokens, non_blocking=True)
    host_logprobs.copy_(logprobs, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host_tokens, host_logprobs, ready


def _check_prefills_first(seq_group_metadata_list: list[SequenceGroupMetadata]) -> None:
    seen_decode = False
    for metadata in seq_group_metadata_list:
        if metadata.is_prompt and seen_decode:
            raise ValueError("prefill groups must come before decode groups in a batch.")
        seen_decode |= not metadata.is_prompt


def _to_device(array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    # Pinned staging memory lets the host-to-device copy run asynchronously on a GPU.
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
