"""The draft-model proposer: `DraftModelWorker`.

Plays the part of `vllm/spec_decode/multi_step_worker.py` (vLLM's draft proposer; not to be
confused with minivllm's multi-step scheduling worker): a `Worker` for a small model with
the target's tokenizer, which proposes k tokens per sequence by running k forward passes.

Its KV cache: tensors of its own (its layers, heads and head size), sized to the SAME number
of blocks as the target's, indexed by the SAME block tables. The scheduler's block manager
then serves both models at once: a block number means the same tokens in both caches, every
swap, copy-on-write copy and prefix-cache hit applies to both (`apply_block_moves` runs on
each cache), a preempted sequence is recomputed in both, and freeing a block frees it for
both. The price: a block costs the sum of both models' bytes (`SpecDecodeWorker` profiles
with that sum). vLLM 0.6 shares the block tables the same way.

What the draft's cache holds. Before a decode step of a sequence of length L, the target's
cache holds positions 0..L-2 (the last token is the step's input). The draft's holds at
least 0..L-3: each step the draft first recomputes positions L-2 and L-1 (one 2-token
"prefill" per sequence) and then feeds its own proposals, writing positions L .. L+k-2. If
the target accepts all k proposals the draft never wrote the k-th (it was only sampled), so
the next step's two-token start covers it. Rewriting position L-2 is idempotent (same token,
same context). The draft runs this start for every decoding sequence, speculating or not,
so its cache keeps up with the target's; a prefill runs on both models. Where the draft's
cache could still be stale (a prefix-cache block registered from a sequence that finished
right after a step), only its proposals suffer: acceptance decides what is emitted.
"""

from __future__ import annotations

import dataclasses

import torch

from minivllm.attention import build_attn_metadata
from minivllm.attention.metadata import to_device
from minivllm.config import EngineConfig
from minivllm.model_executor.layers.rejection_sampler import sample_from
from minivllm.sequence import SequenceGroupMetadata
from minivllm.spec_decode.util import Proposals, sampling_probs
from minivllm.worker.worker import Worker

# The start of a decode step's proposal: the last two tokens (see the module docstring).
_CATCH_UP_TOKENS = 2


class DraftModelWorker(Worker):
    """A `Worker` for the draft model (its own runner, CUDA graphs and cache engine)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        draft_config = engine_config.speculative_config.draft_model_config
        super().__init__(dataclasses.replace(engine_config, model_config=draft_config, speculative_config=None))

    def run_prefill(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> None:
        """Write the draft's K/V for a prefill batch (the target samples; the draft does not)."""
        runner = self.model_runner
        model_input = runner.prepare_model_input(seq_group_metadata_list)
        runner.run_model(model_input.input_ids, model_input.positions, model_input.attn_metadata, self.kv_caches)
        # The batch builder made seeded generators for seeded requests; the draft never samples
        # for them (they do not speculate), so it keeps none.
        runner.generators.clear()

    @torch.inference_mode()
    def propose(self, seq_group_metadata_list: list[SequenceGroupMetadata], num_proposals: list[int]) -> Proposals:
        """k = max(num_proposals) draft steps. Every sequence of the batch takes part in the
        first (the catch-up); step s feeds token s to the groups still wanting more."""
        k = max(num_proposals, default=0)
        seqs = [(m, seq_id, data, wanted) for m, wanted in zip(seq_group_metadata_list, num_proposals)
                for seq_id, data in m.seq_data.items()]
        spec = [i for i, (_, _, _, wanted) in enumerate(seqs) if wanted]
        token_ids = torch.zeros(len(spec), k, dtype=torch.long, device=self.device)
        probs = torch.zeros(len(spec), k, self.model_config.hf_config.vocab_size, device=self.device)
        hidden = self._catch_up(seqs)
        if not spec:
            return Proposals(token_ids, [], probs)
        rows = torch.arange(len(spec), device=self.device)
        # Each sequence's last row of the catch-up predicts its first proposal.
        last_rows = [_CATCH_UP_TOKENS * i + _CATCH_UP_TOKENS - 1 for i in spec]
        self._sample_into(hidden[last_rows], [seqs[i][0].sampling_params for i in spec], rows, 0, token_ids, probs)
        for step in range(1, k):
            active = [r for r, i in enumerate(spec) if seqs[i][3] > step]
            hidden = self._decode([seqs[spec[r]] for r in active], step, token_ids[active, step - 1])
            self._sample_into(hidden, [seqs[spec[r]][0].sampling_params for r in active],
                              torch.tensor(active, device=self.device), step, token_ids, probs)
        return Proposals(token_ids, [seqs[i][3] for i in spec], probs)

    def _catch_up(self, seqs) -> torch.Tensor:
        """Positions L-2 and L-1 of every sequence, as 2-token prefills: `[2 * num_seqs, hidden]`."""
        input_ids, positions, tables = [], [], []
        for metadata, seq_id, data, _ in seqs:
            length = data.get_len()
            input_ids += data.get_token_ids()[length - _CATCH_UP_TOKENS:]
            positions += [length - 2, length - 1]
            tables.append(metadata.block_tables[seq_id])
        context_lens = [p for p in positions[::_CATCH_UP_TOKENS]]
        md = build_attn_metadata(tables, context_lens, [_CATCH_UP_TOKENS] * len(seqs), len(seqs),
                                 self.cache_config.block_size, self.device)
        return self._forward(input_ids, positions, md)

    def _decode(self, seqs, step: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Proposal `step` (already on the device) of each sequence, at position L-1+step."""
        positions = [data.get_len() - 1 + step for _, _, data, _ in seqs]
        md = build_attn_metadata([m.block_tables[seq_id] for m, seq_id, _, _ in seqs], positions,
                                 [1] * len(seqs), 0, self.cache_config.block_size, self.device)
        return self.model_runner.run_model(input_ids, to_device(torch.tensor(positions), self.device), md,
                                           self.kv_caches)

    def _forward(self, input_ids: list[int], positions: list[int], md) -> torch.Tensor:
        return self.model_runner.run_model(to_device(torch.tensor(input_ids, dtype=torch.long), self.device),
                                           to_device(torch.tensor(positions, dtype=torch.long), self.device),
                                           md, self.kv_caches)

    def _sample_into(self, hidden: torch.Tensor, params, rows: torch.Tensor, step: int,
                     token_ids: torch.Tensor, probs: torch.Tensor) -> None:
        """Draw each row's proposal from the draft's distribution (processed like the target's)."""
        q, _ = sampling_probs(self.model_runner.model.compute_logits(hidden), params)
        token_ids[rows, step] = sample_from(q)
        probs[rows, step] = q
