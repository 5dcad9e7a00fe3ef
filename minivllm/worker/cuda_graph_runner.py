"""Forward passes replayed from captured CUDA graphs: `CUDAGraphModelRunner`.

Mirrors the `CUDAGraphRunner` part of `vllm/worker/model_runner.py` (v0), kept in a file of
its own so the plain `ModelRunner` reads as if graphs did not exist. `selector.py` picks it
on a GPU unless `enforce_eager`, with one pipeline stage and a backend whose ops capture.

Why: a layer is about nine kernels, and launching them from Python costs the host more time
than a small batch takes the GPU to run them. A captured graph replays the whole forward pass
with one launch. Graphs freeze shapes and addresses, so each graph has a padded shape and
each step's inputs are copied into static buffers:

    decode   one graph per batch size (1, 2, 4, 8, then every 16); padding rows attend to one
             token of block 0 and write nowhere
    prefill  one graph per token count (every 512 up to 4,096), for any split of the tokens
             into sequences: the prefill kernel's grid depends on the two counts alone;
             padding sequences have 0 tokens and padding rows belong to none
A batch mixing prefills and decodes (chunked prefill) runs eagerly. vLLM v0 captures decodes
only; V1's piecewise graphs capture prefills too.
"""

from __future__ import annotations

import logging
import time

import torch

from minivllm.attention import AttentionMetadata
from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Decode batch sizes with a captured CUDA graph (a batch is padded up to the next one):
# dense where small batches are common, then every 16. These are minivllm's choice (nano-vllm
# uses the same shape of list); vLLM v0 captures 1, 2, 4 and then multiples of 8.
_SMALL_GRAPH_BATCH_SIZES = (1, 2, 4, 8)
_GRAPH_BATCH_SIZE_STEP = 16
# Prefill token counts with a graph: every 512 up to 4,096 (vLLM v0's default budget for a
# 4k context). Padding costs the GPU at most 511 tokens; launching eagerly costs the host more
# than a 4k-token prefill of a small model takes the GPU (docs/benchmarks.md, roofline).
_PREFILL_GRAPH_TOKEN_STEP = 512
_MAX_PREFILL_GRAPH_TOKENS = 4096
_PAD_SLOT = -1  # a padding row writes no cache slot
_PAD_BLOCK = 0


class CUDAGraphModelRunner(ModelRunner):
    """A `ModelRunner` whose steps replay a captured graph, unless a step mixes prefills and
    decodes or outgrows every graph."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graph_runners: dict[int, CUDAGraphRunner] = {}  # decode, by batch size
        self.prefill_graph_runners: dict[int, PrefillCUDAGraphRunner] = {}  # by token count
        # The most decode rows one forward pass runs: a row per sequence. A speculative
        # worker raises it before capture (its scoring pass is k + 1 rows per sequence).
        self.max_decode_rows = self.scheduler_config.max_num_seqs

    @torch.inference_mode()
    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture a prefill graph per token count in `prefill_graph_sizes()`, then a decode
        graph per batch size in `graph_batch_sizes()`, all in one memory pool."""
        start = time.perf_counter()
        sizes, prefill_sizes = self.graph_batch_sizes(), self.prefill_graph_sizes()
        max_model_len = self.scheduler_config.max_model_len
        max_blocks = -(-max_model_len // self.block_size)
        pool = None
        if prefill_sizes:
            buffers = _GraphBuffers(max(prefill_sizes), self.scheduler_config.max_num_seqs, max_blocks,
                                    self.device, query_len=0)
            # Largest first: later (smaller) graphs reuse the first one's memory.
            for num_tokens in reversed(prefill_sizes):
                runner = PrefillCUDAGraphRunner(self.model, kv_caches, buffers, num_tokens, max_model_len)
                pool = runner.capture(pool)
                self.prefill_graph_runners[num_tokens] = runner
        buffers = _GraphBuffers(max(sizes), max(sizes), max_blocks, self.device, query_len=1)
        for batch_size in reversed(sizes):
            runner = CUDAGraphRunner(self.model, kv_caches, buffers, batch_size, max_model_len)
            pool = runner.capture(pool)
            self.graph_runners[batch_size] = runner
        # Each capture's warm-up pass compiles (or loads) the Triton kernels of its shape.
        logger.info("captured CUDA graphs for %d decode batch sizes %s and %d prefill token counts %s in %.2f s",
                    len(sizes), sizes, len(prefill_sizes), prefill_sizes, time.perf_counter() - start)

    def graph_batch_sizes(self) -> list[int]:
        limit = self.max_decode_rows
        sizes = [s for s in _SMALL_GRAPH_BATCH_SIZES if s <= limit]
        sizes += list(range(_GRAPH_BATCH_SIZE_STEP, limit + 1, _GRAPH_BATCH_SIZE_STEP))
        if sizes[-1] < limit:
            sizes.append(limit)
        return sizes

    def prefill_graph_sizes(self) -> list[int]:
        if self.engine_config.parallel_config.tensor_parallel_size > 1:
            # Eager: a prefill's all-reduces outgrow the symmetric buffer and go through NCCL,
            # and the graphs here hold only the custom all-reduce.
            return []
        limit = min(self.scheduler_config.max_num_batched_tokens, _MAX_PREFILL_GRAPH_TOKENS)
        sizes = list(range(_PREFILL_GRAPH_TOKEN_STEP, limit + 1, _PREFILL_GRAPH_TOKEN_STEP))
        return sizes if sizes and sizes[-1] == limit else sizes + [limit]

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                  kv_caches: list[torch.Tensor]) -> torch.Tensor:
        # A batch of one kind replays the graph of the smallest captured size that holds it.
        md = attn_metadata
        if md.num_prefills == 0:
            graphs, size = self.graph_runners, md.num_decode_tokens
        elif md.num_decode_tokens == 0 and md.num_prefills <= self.scheduler_config.max_num_seqs:
            graphs, size = self.prefill_graph_runners, md.num_prefill_tokens
        else:  # prefills and decodes together
            graphs, size = {}, 0
        if graphs and size <= max(graphs):
            runner = graphs[min(s for s in graphs if s >= size)]
            return runner.replay(input_ids, positions, attn_metadata)
        return super().run_model(input_ids, positions, attn_metadata, kv_caches)


class _GraphBuffers:
    """Static input tensors shared by the captured graphs of one kind (a graph reads fixed
    addresses), holding a batch of padding: sequences of `query_len` new tokens (1 for
    decode, 0 for prefill) that write no cache slot."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 query_len: int) -> None:
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), _PAD_SLOT, dtype=torch.long, device=device)
        self.seq_lens = torch.full((max_seqs,), query_len, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device) * query_len
        self.block_tables = torch.full((max_seqs, max_blocks), _PAD_BLOCK, dtype=torch.int32, device=device)


class CUDAGraphRunner:
    """One captured decode forward pass for a fixed batch size."""

    def __init__(self, model, kv_caches, buffers: _GraphBuffers, batch_size: int, max_seq_len: int) -> None:
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.batch_size = batch_size  # rows of the forward pass: decode sequences, or prefill tokens
        self.attn_metadata = self._captured_metadata(max_seq_len)
        self.graph = torch.cuda.CUDAGraph()
        self.output: torch.Tensor | None = None

    def _captured_metadata(self, max_seq_len: int) -> AttentionMetadata:
        """The metadata the graph reads: views of the buffers, `batch_size` decode rows."""
        b, buffers = self.batch_size, self.buffers
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
            slot_mapping=buffers.slot_mapping[:b], seq_lens=buffers.seq_lens[:b],
            query_start_loc=buffers.query_start_loc[: b + 1], block_tables=buffers.block_tables[:b],
            max_query_len=1, max_seq_len=max_seq_len,
        )

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


class PrefillCUDAGraphRunner(CUDAGraphRunner):
    """One captured prefill forward pass for a fixed token count (`batch_size`), for up to
    `max_num_seqs` sequences of any lengths (the buffers' rows)."""

    def _captured_metadata(self, max_seq_len: int) -> AttentionMetadata:
        t, buffers = self.batch_size, self.buffers
        return AttentionMetadata(
            num_prefills=buffers.seq_lens.shape[0], num_prefill_tokens=t, num_decode_tokens=0,
            slot_mapping=buffers.slot_mapping[:t], seq_lens=buffers.seq_lens,
            query_start_loc=buffers.query_start_loc, block_tables=buffers.block_tables,
            max_query_len=t, max_seq_len=max_seq_len,
        )

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        n, seqs, buffers = input_ids.shape[0], md.num_prefills, self.buffers
        buffers.input_ids[:n].copy_(input_ids)
        buffers.positions[:n].copy_(positions)
        buffers.slot_mapping[:n].copy_(md.slot_mapping)
        buffers.slot_mapping[n:self.batch_size].fill_(_PAD_SLOT)
        buffers.seq_lens[:seqs].copy_(md.seq_lens)
        buffers.seq_lens[seqs:].fill_(0)
        buffers.query_start_loc[:seqs + 1].copy_(md.query_start_loc)
        buffers.query_start_loc[seqs + 1:].fill_(n)  # sequences of 0 tokens after the last
        buffers.block_tables[:seqs, :md.block_tables.shape[1]].copy_(md.block_tables)
        self.graph.replay()
        return self.output[:n]
