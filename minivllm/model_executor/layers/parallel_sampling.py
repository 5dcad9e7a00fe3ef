"""Several sequences per request: parallel sampling (`n`, `best_of` > 1) and beam search.

Mirrors the `best_of` and beam branches of `vllm/model_executor/layers/sampler.py` (v0).
The `Sampler` sends here the groups `is_parallel` picks; their rows then go through the plain
path's own steps (`DeviceSampler`: min_tokens, penalties, `SampleTokens`):

    fan-out       a prompt's one row drawn `best_of` times, one seed per sibling
    siblings      a seeded request's sequences, each with its own seed (sibling j: `sibling_seed`)
    beam search   the 2 x beam_width best (parent beam, token) pairs by cumulative logprob
                  (vLLM 0.6 v0, the paper's section 4.4); the engine keeps beam_width of them,
                  forking parents that win several children and freeing those that win none

Unseeded siblings after the fan-out need nothing of this: each is a plain row.
"""

from __future__ import annotations

import dataclasses

import torch

from minivllm.model_executor.layers.device_sampler import DeviceSampler
from minivllm.model_executor.sampling_metadata import SequenceGroupToSample, sampled_seq_ids
from minivllm.sampling_params import SamplingType
from minivllm.sequence import SequenceGroupOutput, SequenceOutput

# A beam-search step proposes twice the beam width, so that even if every beam_width best
# candidates end in EOS, beam_width candidates can still continue (as in transformers).
_BEAM_CANDIDATE_FACTOR = 2
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # an odd 64-bit step: sibling seeds far apart


def is_parallel(group: SequenceGroupToSample) -> bool:
    """Beam search, a fan-out, or a seeded request with several sequences."""
    params = group.sampling_params
    return (params.sampling_type == SamplingType.BEAM or (params.best_of > 1 and _is_first_sample(group))
            or (params.seed is not None and len(sampled_seq_ids(group)) > 1))


def _is_first_sample(group: SequenceGroupToSample) -> bool:
    """The request's first token: one prompt row fans out into `best_of` samples."""
    return group.is_prompt and all(d.get_output_len() == 0 for d in group.seq_data.values())


def sibling_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's `index`-th sample (index 0: the request's own seed)."""
    return (seed + index * _GOLDEN_GAMMA) % 2**63


def sample_parallel(sampler: DeviceSampler, logits: torch.Tensor, groups: list[SequenceGroupToSample],
                    outputs: list[SequenceGroupOutput]) -> None:
    """Fill each group's `outputs[i].samples`. logits: `[num_selected, vocab]` (all rows)."""
    drawn = [(g, o) for g, o in zip(groups, outputs) if g.sampling_params.sampling_type != SamplingType.BEAM]
    beams = [(g, o) for g, o in zip(groups, outputs) if g.sampling_params.sampling_type == SamplingType.BEAM]
    if drawn:
        _sample_siblings(sampler, logits, *zip(*drawn))
    if beams:
        _beam_search(sampler, logits, *zip(*beams))


def _sample_siblings(sampler: DeviceSampler, logits: torch.Tensor, groups: tuple, outputs: tuple) -> None:
    """A fan-out becomes `best_of` copies of its prompt row (all children of its one sequence)."""
    rows = [_fanned_out(g) if g.sampling_params.best_of > 1 and _is_first_sample(g) else g for g in groups]
    t = sampler.prepare(rows, logits.shape[-1], logits.device)
    seeds = [sibling_seed(g.sampling_params.seed, j) for g in rows for j in range(len(g.sample_indices))
             if g.sampling_params.seed is not None]
    if seeds:  # every group here is seeded, or a fan-out of an unseeded one (its fresh seeds stay)
        seeded = torch.tensor([g.sampling_params.seed is not None for g in rows for _ in g.sample_indices])
        t.seeds = t.seeds.masked_scatter(seeded.to(t.seeds.device), torch.tensor(seeds).to(t.seeds.device))
    sample_logits = logits[[r for g in rows for r in g.sample_indices]]
    drawn = sampler(sample_logits, t).to_host()
    for output, samples in zip(outputs, drawn.sequence_outputs(rows, t)):
        output.samples = samples


def _fanned_out(group: SequenceGroupToSample) -> SequenceGroupToSample:
    best_of = group.sampling_params.best_of
    return dataclasses.replace(group, seq_ids=group.seq_ids[:1] * best_of, sample_indices=group.sample_indices * best_of)


def _beam_search(sampler: DeviceSampler, logits: torch.Tensor, groups: tuple, outputs: tuple) -> None:
    """Logprobs after min_tokens and penalties (temperature 1, nothing truncated), then each
    group's candidates."""
    t = sampler.prepare(list(groups), logits.shape[-1], logits.device)
    if sampler.token_stats is not None:  # the beams of the last step that were not kept
        for group in groups:
            sampler.token_stats.release_dropped_sequences(group.request_id, set(group.seq_ids))
    rows = [r for g in groups for r in g.sample_indices]
    logprobs = torch.log_softmax(sampler.process(logits[rows], t).float(), dim=-1)
    start = 0
    for group, output in zip(groups, outputs):
        group_logprobs = logprobs[start : start + len(group.sample_indices)]
        start += len(group.sample_indices)
        parents, tokens = _beam_search_candidates(group, group_logprobs)
        num_logprobs = group.sampling_params.logprobs
        output.samples = [_make_output(group.seq_ids[p], t, group_logprobs[p], num_logprobs)
                          for p, t in zip(parents, tokens)]


def _beam_search_candidates(group: SequenceGroupToSample, logprobs: torch.Tensor) -> tuple[list[int], list[int]]:
    """The 2 x beam_width best (parent row, token) pairs by cumulative logprob."""
    num_candidates = _BEAM_CANDIDATE_FACTOR * group.sampling_params.best_of
    if _is_first_sample(group):
        # All beams start from the same prompt: take the best tokens of its single row.
        tokens = torch.topk(logprobs[0], num_candidates).indices.tolist()
        return [0] * num_candidates, tokens
    cumulative = logprobs.new_tensor([group.seq_data[seq_id].cumulative_logprob for seq_id in sampled_seq_ids(group)])
    scores = (logprobs + cumulative.unsqueeze(1)).flatten()
    flat = torch.topk(scores, num_candidates).indices.tolist()
    vocab_size = logprobs.shape[-1]
    return [i // vocab_size for i in flat], [i % vocab_size for i in flat]


def _make_output(parent_seq_id: int, token: int, row_logprobs: torch.Tensor, num_logprobs: int | None) -> SequenceOutput:
    """The chosen token's logprob (+ its rank and the top-N when the request asked)."""
    logprobs = {token: float(row_logprobs[token])}
    rank = None
    if num_logprobs is not None:
        rank = int((row_logprobs > row_logprobs[token]).sum()) + 1
        if num_logprobs > 0:
            top = torch.topk(row_logprobs, num_logprobs)
            for value, top_token in zip(top.values.tolist(), top.indices.tolist()):
                logprobs.setdefault(top_token, value)
    return SequenceOutput(parent_seq_id, token, logprobs, rank)
