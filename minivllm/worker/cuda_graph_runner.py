"""Decode steps replayed from captured CUDA graphs: `CUDAGraphModelRunner`.

Mirrors the `CUDAGraphRunner` part of `vllm/worker/model_runner.py` (v0), kept in a file of
its own so the plain `ModelRunner` reads as if graphs did not exist. `selector.py` picks it
on a GPU unless `enforce_eager`, with one pipeline stage and a backend whose ops capture.

Why: a decode step runs dozens of small kernels per layer, and for a small batch the time
to *launch* them rivals the time to run them. A captured graph replays the whole forward
pass with one launch. Graphs freeze shapes and addresses, so we capture one graph per
padded batch size and copy each step's inputs into static buffers. Only decode batches are
captured: their shapes depend on the batch size alone (one token per sequence, block
tables of a fixed width), whereas a prefill's token count changes every step, and a
prefill is compute-bound anyway (big matmuls hide the launch cost).
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
# Padding rows of a graph batch write nowhere and attend to one token of block 0.
_PAD_SLOT = -1
_PAD_BLOCK = 0


class CUDAGraphModelRunner(ModelRunner):
    """A `ModelRunner` whose decode-only steps replay a captured graph (prefills run eagerly)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graph_runners: dict[int, CUDAGraphRunner] = {}
        # The most decode rows one forward pass runs: a row per sequence. A speculative
        # worker raises it before capture (its scoring pass is k + 1 rows per sequence).
        self.max_decode_rows = self.scheduler_config.max_num_seqs

    @torch.inference_mode()
    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture one decode graph per batch size in `graph_batch_sizes()`."""
        start = time.perf_counter()
        sizes = self.graph_batch_sizes()
        max_model_len = self.scheduler_config.max_model_len
        buffers = _GraphBuffers(max(sizes), -(-max_model_len // self.block_size), self.device)
        pool = None
        # Largest first: later (smaller) graphs reuse the first one's memory pool.
        for batch_size in reversed(sizes):
            runner = CUDAGraphRunner(self.model, kv_caches, buffers, batch_size, max_model_len)
            pool = runner.capture(pool)
            self.graph_runners[batch_size] = runner
        # Each capture's warm-up pass compiles (or loads) the Triton kernels of its batch size.
        logger.info("captured CUDA graphs for %d decode batch sizes %s in %.2f s", len(sizes), sizes,
                    time.perf_counter() - start)

    def graph_batch_sizes(self) -> list[int]:
        limit = self.max_decode_rows
        sizes = [s for s in _SMALL_GRAPH_BATCH_SIZES if s <= limit]
        sizes += list(range(_GRAPH_BATCH_SIZE_STEP, limit + 1, _GRAPH_BATCH_SIZE_STEP))
        if sizes[-1] < limit:
            sizes.append(limit)
        return sizes

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                  kv_caches: list[torch.Tensor]) -> torch.Tensor:
        batch_size = attn_metadata.num_decode_tokens
        # A decode-only batch replays the graph of the smallest captured size that holds it.
        if attn_metadata.num_prefills == 0 and batch_size <= max(self.graph_runners, default=0):
            runner = self.graph_runners[min(s for s in self.graph_runners if s >= batch_size)]
            return runner.replay(input_ids, positions, attn_metadata)
        return super().run_model(input_ids, positions, attn_metadata, kv_caches)


class _GraphBuffers:
    """Static input tensors shared by every captured graph (a graph reads fixed addresses)."""

    def __init__(self, max_batch_size: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch_size,), _PAD_SLOT, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_batch_size, max_blocks), _PAD_BLOCK, dtype=torch.int32, device=device)


class CUDAGraphRunner:
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
