"""Speculative decoding's worker: `SpecDecodeWorker`.

Mirrors `vllm/spec_decode/spec_decode_worker.py` (v0). A `Worker` for the target model that
owns a proposer (`DraftModelWorker` or `NGramWorker`) and runs each decode step as:

    1. propose   the proposer guesses k_i <= k tokens for sequence i (its lookahead slots)
    2. score     ONE target forward pass over each sequence's last token and its guesses,
                 k_i + 1 decode rows over the cached context (batch expansion, a CUDA-graph
                 replay on a GPU); row j predicts the token after guess j
    3. accept    the rejection sampler keeps a prefix of the guesses and draws one more token

The accepted tokens come back as consecutive `SamplerOutput`s, as a multi-step run's do:
output s holds token s of every sequence that emitted more than s tokens; the first is a
`SpecDecodeSamplerOutput` with the acceptance counts. Sequences that cannot speculate
(`DeviceSampler.depends_on_logits_alone`) ride along with one token each, sampled by the
plain `Sampler`; a prefill batch runs the target plainly (and the draft, for its cache).
Rejected guesses' K/V lie at or past the next step's input position: nothing is rolled back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from minivllm.attention import build_attn_metadata
from minivllm.attention.packed_copy import to_device_together
from minivllm.config import EngineConfig
from minivllm.model_executor.layers.device_sampler import DeviceSampler
from minivllm.model_executor.layers.rejection_sampler import NO_TOKEN, RejectionSampler
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sequence import (ExecuteModelRequest, SamplerOutput, SequenceData, SequenceGroupMetadata,
                               SequenceGroupOutput, SequenceOutput)
from minivllm.spec_decode.draft_model_worker import CATCH_UP_TOKENS, DraftModelWorker
from minivllm.spec_decode.metrics import AcceptanceCounter, SpecDecodeWorkerMetrics
from minivllm.spec_decode.ngram_worker import NGramWorker
from minivllm.spec_decode.util import Proposals, all_greedy, expand_batch, sampling_probs
from minivllm.worker.cuda_graph_runner import CUDAGraphModelRunner
from minivllm.worker.worker import Worker

# The largest batch-expanded pass replayed from a graph; larger ones run eagerly.
_MAX_GRAPH_ROWS = 512


@dataclass
class SpecDecodeSamplerOutput(SamplerOutput):
    """The first output of a speculative step, with the acceptance counts so far."""

    spec_decode_worker_metrics: SpecDecodeWorkerMetrics | None = None


class SpecDecodeWorker(Worker):
    """The target model's worker, speculating with `engine_config.speculative_config`."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        spec = engine_config.speculative_config
        self.proposer = NGramWorker(spec) if spec.method == "ngram" else DraftModelWorker(engine_config)
        self.rejection_sampler = RejectionSampler(self.model_runner.backend)
        self.counter = AcceptanceCounter(spec.num_speculative_tokens)
        self.num_speculative_tokens = spec.num_speculative_tokens
        # Rounds of propose-score-accept per schedule (the scheduler reserved their slots).
        self.num_rounds = self.scheduler_config.num_scheduler_steps
        # Batch expansion scores k + 1 rows per sequence, the draft catches up with 2: capture
        # graphs for those batches (up to a bound: past it a pass is compute-bound anyway).
        max_num_seqs = self.scheduler_config.max_num_seqs
        _raise_graph_rows(self.model_runner, max_num_seqs * (spec.num_speculative_tokens + 1))
        if isinstance(self.proposer, DraftModelWorker):
            _raise_graph_rows(self.proposer.model_runner, max_num_seqs * CATCH_UP_TOKENS)

    # ------------------------------------------------------------------ both models
    def load_model(self) -> None:
        super().load_model()
        self.proposer.load_model()

    def get_cache_block_size_bytes(self) -> int:
        """A block holds its tokens in both caches (the block tables are shared)."""
        return super().get_cache_block_size_bytes() + self.proposer.get_cache_block_size_bytes()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        super().initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.proposer.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def apply_block_moves(self, req: ExecuteModelRequest) -> None:
        super().apply_block_moves(req)
        self.proposer.apply_block_moves(req)

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        """One `SamplerOutput` for a prefill or a step where no one speculates; else one per
        emitted token position, over every round of the run: `num_scheduler_steps` rounds
        when every sequence speculates (multi-step), one otherwise."""
        req = execute_model_req
        metadata_list = req.seq_group_metadata_list
        self.apply_block_moves(req)
        self.model_runner.release_requests(req.finished_requests_ids)
        if not metadata_list:  # a step of block moves only (a swap-out)
            return [self._plain_step(metadata_list)]
        if any(m.is_prompt for m in metadata_list):
            self.proposer.run_prefill(metadata_list)
            return [self._plain_step(metadata_list)]
        outputs = self._round(metadata_list)
        if self.num_rounds > 1 and all(self._num_proposals(m) for m in metadata_list):
            outputs = self._more_rounds(metadata_list, outputs)
        return outputs

    def _round(self, metadata_list: list[SequenceGroupMetadata]) -> list[SamplerOutput]:
        """Propose, score and accept once. A sequence the proposer found no guess for is scored
        alone (one row) and accepts nothing: its token comes from the rejection sampler too."""
        num_proposals = [self._num_proposals(m) for m in metadata_list]
        proposals = self.proposer.propose(metadata_list, num_proposals)  # a draft catches up even so
        if not any(num_proposals):
            return [self._plain_step(metadata_list)]
        return self._score_and_accept(metadata_list, num_proposals, proposals)

    def _more_rounds(self, metadata_list: list[SequenceGroupMetadata], outputs: list[SamplerOutput]
                     ) -> list[SamplerOutput]:
        """Rounds 2 .. num_rounds of a multi-step run: each group goes on from the tokens the
        rounds before emitted, within the lookahead slots its blocks hold (out of slots, it stops;
        past a stop string or EOS, the engine drops its tokens, as after a multi-step run)."""
        last_round = outputs
        for _ in range(self.num_rounds - 1):
            metadata_list = [_advanced(m, _emitted(last_round, i)) for i, m in enumerate(metadata_list)]
            live = [i for i, m in enumerate(metadata_list) if m.num_lookahead_slots >= 0]
            if not live:
                break
            last_round = [_spread(o, live, len(metadata_list)) for o in self._round([metadata_list[i] for i in live])]
            outputs = outputs + last_round
        outputs[0] = SpecDecodeSamplerOutput(outputs[0].outputs, spec_decode_worker_metrics=self.counter.metrics())
        return outputs

    def _plain_step(self, metadata_list: list[SequenceGroupMetadata]) -> SamplerOutput:
        return self.model_runner.execute_model(metadata_list, self.kv_caches)

    def _num_proposals(self, metadata: SequenceGroupMetadata) -> int:
        """Guesses a sequence makes this round: k, fewer when its slots run out, none when its
        sampling needs more than the logits (penalties, seeds, logprobs)."""
        can = DeviceSampler.depends_on_logits_alone(metadata.sampling_params, list(metadata.seq_data.values()))
        return min(metadata.num_lookahead_slots, self.num_speculative_tokens) if can else 0

    def _score_and_accept(self, metadata_list: list[SequenceGroupMetadata], num_proposals: list[int],
                          proposals: Proposals) -> list[SamplerOutput]:
        spec_groups = [i for i, wanted in enumerate(num_proposals) if wanted]
        num_proposed = dict(zip(spec_groups, proposals.num_proposed))
        guesses = {i: proposals.token_ids[r][: num_proposed[i]] for r, i in enumerate(spec_groups)}
        logits, first_rows = self._score(metadata_list, guesses)
        plain = [i for i in range(len(metadata_list)) if i not in num_proposed]
        plain_output = self._sample_plain([metadata_list[i] for i in plain], logits, [first_rows[i] for i in plain])
        if self._greedy_shortcut([metadata_list[i] for i in spec_groups]):
            accepted, logprobs = self._accept_greedy(logits, [first_rows[i] for i in spec_groups],
                                                     [guesses[i] for i in spec_groups])
        else:
            accepted, logprobs = self._accept(metadata_list, spec_groups, proposals, logits, first_rows)
            accepted, logprobs = accepted.tolist(), logprobs.tolist()
        emitted = [sum(token != NO_TOKEN for token in row) for row in accepted]
        self.counter.record(proposals.num_proposed, emitted)
        return self._outputs(metadata_list, dict(zip(plain, plain_output)), spec_groups, accepted, logprobs, emitted)

    def _score(self, metadata_list: list[SequenceGroupMetadata], guesses: dict[int, list[int]]):
        """The target's logits at every scored position: `[num_tokens, vocab]`, and the first
        row of each group. Group i's sequence computes its last token and `guesses[i]`.

        Batch expansion (vLLM's `BatchExpansionTop1Scorer`): each scored token is a decode row
        of its own, over the same block table, seeing one more token than the row before:

            tokens     t   g0  g1  g2         (last token, then the guesses)
            positions  L-1 L   L+1 L+2
            seq_lens   L   L+1 L+2 L+3        row j attends to the guesses before it

        Every row writes its K/V before any row attends (the layer writes, then reads), so a
        (k+1)-token scoring pass is a decode batch: a CUDA-graph replay on a GPU.
        """
        tokens, starts, seq_tables, first_rows, num_rows = [], [], [], [], 0
        for i, metadata in enumerate(metadata_list):
            first_rows.append(num_rows)
            for seq_id, data in metadata.seq_data.items():
                tokens.append([data.get_last_token_id()] + guesses.get(i, []))
                num_rows += len(tokens[-1])
                starts.append(data.get_len() - 1)
                seq_tables.append(metadata.block_tables[seq_id])
        input_ids, positions, tables = expand_batch(tokens, starts, seq_tables)
        md = build_attn_metadata(tables, positions, [1] * len(positions), 0, self.cache_config.block_size,
                                 self.device)
        input_ids, positions = to_device_together([torch.tensor(input_ids, dtype=torch.long),
                                                   torch.tensor(positions, dtype=torch.long)], self.device)
        hidden = self.model_runner.run_model(input_ids, positions, md, self.kv_caches)
        return self.model_runner.model.compute_logits(hidden), first_rows

    def _sample_plain(self, metadata_list: list[SequenceGroupMetadata], logits: torch.Tensor,
                      first_rows: list[int]) -> list[SequenceGroupOutput]:
        """The plain sampler on the rows of the groups that did not speculate (one per sequence)."""
        if not metadata_list:
            return []
        rows = [first + j for m, first in zip(metadata_list, first_rows) for j in range(len(m.seq_data))]
        sampling_metadata = SamplingMetadata.prepare(metadata_list, [1] * len(metadata_list), self.device)
        return self.model_runner.sampler(logits[rows], sampling_metadata).outputs

    def _greedy_shortcut(self, spec_metadata: list[SequenceGroupMetadata]) -> bool:
        """Every speculating request is greedy and the rejection rule is the package's own (a
        sampler that brings its own rule, as a lab's, decides every row itself)."""
        own_rule = type(self.rejection_sampler).__call__ is RejectionSampler.__call__
        return own_rule and all_greedy([m.sampling_params for m in spec_metadata])

    def _accept_greedy(self, logits: torch.Tensor, first_rows: list[int], guesses: list[list[int]]
                       ) -> tuple[list[list[int]], list[list[float]]]:
        """The rejection rule for greedy requests (`RejectionSampler.greedy`): each scored row's
        arg-max and its logprob come to the host, and each sequence keeps its guesses while
        they equal the arg-max. -> emitted tokens and their logprobs, per speculating group."""
        logits = logits.float()
        target = logits.argmax(dim=-1)
        target_logprobs = torch.log_softmax(logits, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
        target, target_logprobs = target.tolist(), target_logprobs.tolist()  # the round's wait for the device
        accepted, logprobs = [], []
        for first, guess in zip(first_rows, guesses):
            tokens = RejectionSampler.greedy(target[first : first + len(guess) + 1], guess)
            accepted.append(tokens)
            logprobs.append(target_logprobs[first : first + len(tokens)])
        return accepted, logprobs

    def _accept(self, metadata_list, spec_groups: list[int], proposals: Proposals, logits: torch.Tensor,
                first_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`[num_spec, k + 1]` accepted tokens (`NO_TOKEN` after the last) and their logprobs:
        the rejection sampler over the target's and the proposer's distributions."""
        k = len(proposals.token_ids[0])
        # Row j of group i's scored positions, for j = 0..k (past its proposals: its last row,
        # never read by the rejection sampler).
        index = torch.tensor([[first_rows[i] + min(j, n) for j in range(k + 1)]
                              for i, n in zip(spec_groups, proposals.num_proposed)])
        index, drafts, num_proposed = to_device_together(
            [index.flatten(), torch.tensor(proposals.token_ids, dtype=torch.long).view(-1, k),
             torch.tensor(proposals.num_proposed)], self.device)
        params = [metadata_list[i].sampling_params for i in spec_groups for _ in range(k + 1)]
        probs, logprobs = sampling_probs(logits[index], params)
        probs, logprobs = probs.view(len(spec_groups), k + 1, -1), logprobs.view(len(spec_groups), k + 1, -1)
        accepted = self.rejection_sampler(probs, drafts, num_proposed, proposals.probs)
        token_logprobs = logprobs.gather(2, accepted.clamp(min=0).unsqueeze(2)).squeeze(2)
        return accepted, token_logprobs

    def _outputs(self, metadata_list, plain_outputs: dict[int, SequenceGroupOutput], spec_groups: list[int],
                 accepted: list[list[int]], logprobs: list[list[float]], emitted: list[int]) -> list[SamplerOutput]:
        """Output s: group i's s-th emitted token (or no samples), the plain groups' tokens at s = 0."""
        spec_rows = {i: r for r, i in enumerate(spec_groups)}
        outputs = []
        for s in range(max(emitted)):
            groups = []
            for i, metadata in enumerate(metadata_list):
                if i not in spec_rows:
                    groups.append(plain_outputs[i] if s == 0 else SequenceGroupOutput(samples=[]))
                    continue
                r = spec_rows[i]
                (seq_id,) = metadata.seq_data
                token = accepted[r][s] if s < emitted[r] else None
                samples = [] if token is None else [SequenceOutput(seq_id, token, {token: logprobs[r][s]})]
                groups.append(SequenceGroupOutput(samples=samples))
            outputs.append(SamplerOutput(groups))
        outputs[0] = SpecDecodeSamplerOutput(outputs[0].outputs, spec_decode_worker_metrics=self.counter.metrics())
        return outputs


def _raise_graph_rows(runner, rows: int) -> None:
    if isinstance(runner, CUDAGraphModelRunner):
        runner.max_decode_rows = max(runner.max_decode_rows, min(rows, _MAX_GRAPH_ROWS))


def _emitted(outputs: list[SamplerOutput], group: int) -> list[int]:
    """The tokens a round emitted for one group (a lone sequence), in order."""
    return [o.outputs[group].samples[0].output_token for o in outputs if o.outputs[group].samples]


def _advanced(metadata: SequenceGroupMetadata, tokens: list[int]) -> SequenceGroupMetadata:
    """The group after its sequence emitted `tokens`: a copy (the engine's own data stays as
    it is) with that many fewer lookahead slots left."""
    ((seq_id, data),) = metadata.seq_data.items()
    data = SequenceData(data.prompt_token_ids, data.output_token_ids + tokens,
                        num_computed_tokens=data.num_computed_tokens + len(tokens))
    return dataclasses.replace(metadata, seq_data={seq_id: data},
                               num_lookahead_slots=metadata.num_lookahead_slots - len(tokens))


def _spread(output: SamplerOutput, live: list[int], num_groups: int) -> SamplerOutput:
    """A round's output over the live groups, laid out over all groups (no samples elsewhere)."""
    groups = [SequenceGroupOutput(samples=[]) for _ in range(num_groups)]
    for row, group in enumerate(live):
        groups[group] = output.outputs[row]
    return SamplerOutput(groups)
