"""The draft-model proposer: `DraftModelWorker`.

Plays the part of `vllm/spec_decode/multi_step_worker.py` (vLLM's draft proposer; not to be
confused with minivllm's multi-step scheduling worker): a `Worker` for a small model with
the target's tokenizer, which proposes k tokens per sequence by running k forward passes.

Its KV cache: tensors of its own (its layers, heads and head size) with the SAME number of
blocks as the target's, indexed by the SAME block tables (as vLLM 0.6), so one block manager
serves both: swaps, copy-on-write copies and prefix hits apply to both caches
(`apply_block_moves` runs on each), and a block costs both models' bytes.

Invariant: before a decode step of a sequence of length L, the target's cache holds
positions 0..L-2 and the draft's at least 0..L-3. Each step the draft first recomputes
positions L-2 and L-1 (two decode rows, idempotent at L-2), then feeds its own proposals,
writing L .. L+k-2; the k-th proposal is only sampled, so the next step's start covers it.
It runs that start for every decoding sequence, speculating or not. A stale draft cache can
only cost acceptance, never change what is emitted.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from minivllm.attention import build_attn_metadata
from minivllm.attention.metadata import to_device
from minivllm.attention.packed_copy import to_device_together
from minivllm.config import EngineConfig
from minivllm.model_executor.layers.sampling_ops import RaceNoise, race
from minivllm.model_executor.sampling_metadata import fresh_seeds
from minivllm.sequence import SequenceData, SequenceGroupMetadata
from minivllm.spec_decode.util import Proposals, all_greedy, expand_batch, sampling_probs
from minivllm.worker.worker import Worker

# The start of a decode step's proposal: the last two tokens (see the module docstring).
CATCH_UP_TOKENS = 2


class _Seq(NamedTuple):
    """One sequence of the batch, and how many guesses it wants (0: it only catches up)."""

    metadata: SequenceGroupMetadata
    seq_id: int
    data: SequenceData
    wanted: int


class DraftModelWorker(Worker):
    """A `Worker` for the draft model (its own runner, CUDA graphs and cache engine)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        draft_config = engine_config.speculative_config.draft_model_config
        super().__init__(dataclasses.replace(engine_config, model_config=draft_config, speculative_config=None))
        self.race_noise = RaceNoise(self.model_runner.backend)  # draws the guesses

    def run_prefill(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> None:
        """Write the draft's K/V for a prefill batch (the target samples; the draft does not)."""
        runner = self.model_runner
        model_input = runner.prepare_model_input(seq_group_metadata_list)
        runner.run_model(model_input.input_ids, model_input.positions, model_input.attn_metadata, self.kv_caches)

    @torch.inference_mode()
    def propose(self, seq_group_metadata_list: list[SequenceGroupMetadata], num_proposals: list[int]) -> Proposals:
        """k = max(num_proposals) draft steps. Every sequence of the batch takes part in the
        first (the catch-up); step s feeds guess s of the sequences that want more than s."""
        k = max(num_proposals, default=0)
        seqs = [_Seq(m, seq_id, data, wanted) for m, wanted in zip(seq_group_metadata_list, num_proposals)
                for seq_id, data in m.seq_data.items()]
        hidden = self._catch_up(seqs)
        # Each sequence's last catch-up row predicts its first guess.
        wanting = [(i, seq) for i, seq in enumerate(seqs) if seq.wanted]
        hidden = hidden[[CATCH_UP_TOKENS * i + CATCH_UP_TOKENS - 1 for i, _ in wanting]]
        spec = [seq for _, seq in wanting]
        # Greedy requests accept a guess iff it is the target's arg-max, whatever q is: the
        # draft's own arg-max is its best guess, and no distributions are needed.
        greedy = all_greedy([seq.metadata.sampling_params for seq in spec])
        token_ids = torch.zeros(len(spec), k, dtype=torch.long, device=self.device)
        probs = None if greedy else torch.zeros(len(spec), k, self.model_config.hf_config.vocab_size,
                                                device=self.device)
        active = list(range(len(spec)))  # rows still guessing
        for step in range(k):
            if step:  # feed the previous guesses (the catch-up fed the real last token)
                active = [r for r in active if spec[r].wanted > step]
                hidden = self._decode([spec[r] for r in active], step, token_ids[active, step - 1])
            logits = self.model_runner.model.compute_logits(hidden)
            if greedy:
                token_ids[active, step] = logits.argmax(dim=-1)
                continue
            q, _ = sampling_probs(logits, [spec[r].metadata.sampling_params for r in active])
            rows = torch.tensor(active, device=self.device)
            seeds = fresh_seeds(len(active), device=q.device)
            noise = self.race_noise(seeds, torch.zeros_like(seeds), q.shape[1])
            token_ids[rows, step] = race(q, noise)  # drawn from the draft's own (processed) distribution
            probs[rows, step] = q
        return Proposals(token_ids.tolist(), [seq.wanted for seq in spec], probs)

    def _catch_up(self, seqs: list[_Seq]) -> torch.Tensor:
        """Positions L-2 and L-1 of every sequence, as two decode rows each (batch expansion,
        as the target's scoring pass; a graph replay on a GPU): `[2 * num_seqs, hidden]`."""
        input_ids, positions, tables = expand_batch(
            [seq.data.get_token_ids()[-CATCH_UP_TOKENS:] for seq in seqs],
            [seq.data.get_len() - CATCH_UP_TOKENS for seq in seqs],
            [seq.metadata.block_tables[seq.seq_id] for seq in seqs])
        md = build_attn_metadata(tables, positions, [1] * len(positions), 0, self.cache_config.block_size,
                                 self.device)
        input_ids, positions = to_device_together([torch.tensor(input_ids, dtype=torch.long),
                                                   torch.tensor(positions, dtype=torch.long)], self.device)
        return self.model_runner.run_model(input_ids, positions, md, self.kv_caches)

    def _decode(self, seqs: list[_Seq], step: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Guess `step` (already on the device) of each sequence, at position L-1+step, as a
        one-token decode (a CUDA-graph replay on a GPU): `[num_seqs, hidden]`."""
        positions = [seq.data.get_len() - 1 + step for seq in seqs]
        md = build_attn_metadata([seq.metadata.block_tables[seq.seq_id] for seq in seqs], positions,
                                 [1] * len(seqs), 0, self.cache_config.block_size, self.device)
        return self.model_runner.run_model(input_ids, to_device(torch.tensor(positions), self.device), md,
                                           self.kv_caches)
