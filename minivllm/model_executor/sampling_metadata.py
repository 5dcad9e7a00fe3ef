"""Which logits rows belong to which request, and how each request samples.

Mirrors `vllm/model_executor/sampling_metadata.py` (v0). Of the batch's flat token stream only
some tokens need logits:

    prefill chunk   its last token if the chunk ends the prompt (`do_sample`), and one row per
                    prompt token when the request asked for `prompt_logprobs`
    decode          the new token of every running sequence

`SamplingMetadata.selected_token_indices` picks those rows out of the hidden states, so the LM
head runs on a handful of rows; each `SequenceGroupToSample` says which of them are its own.
`SamplingTensors` holds the sampling parameters of the rows to sample, as device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minivllm.attention.metadata import to_device
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import SequenceData, SequenceGroupMetadata

if TYPE_CHECKING:
    from minivllm.model_executor.token_stats import TokenStatsCache


@dataclass
class SequenceGroupToSample:
    """One request's share of the selected logits rows.

    seq_ids: its running sequences, in batch order; seq_data: seq_id -> tokens; is_prompt: this
    step prefills (a chunk of) the prompt; do_sample: this step produces a token;
    prompt_logprob_indices: rows for prompt logprobs, prompt_logprob_token_ids the prompt token
    each predicts; sample_indices: rows to sample, one per sequence (one for a prompt).
    """

    request_id: str
    seq_ids: list[int]
    sampling_params: SamplingParams
    seq_data: dict[int, SequenceData]
    is_prompt: bool
    do_sample: bool
    prompt_logprob_indices: list[int]
    prompt_logprob_token_ids: list[int]
    sample_indices: list[int]


@dataclass
class SamplingMetadata:
    """seq_groups: one per scheduled request, in batch order; selected_token_indices:
    `[num_selected]` int64, the rows of the hidden states that get logits."""

    seq_groups: list[SequenceGroupToSample]
    selected_token_indices: torch.Tensor

    @staticmethod
    def prepare(seq_group_metadata_list: list[SequenceGroupMetadata], query_lens: list[int],
                device: torch.device | str) -> SamplingMetadata:
        """query_lens: the new tokens of each group's every sequence, in batch order."""
        seq_groups: list[SequenceGroupToSample] = []
        selected: list[int] = []
        token_offset = 0  # where the group's tokens start in the flat batch
        for metadata, query_len in zip(seq_group_metadata_list, query_lens):
            seq_groups.append(_group_to_sample(metadata, query_len, token_offset, selected))
            token_offset += query_len * len(metadata.seq_data)
        indices = torch.tensor(selected, dtype=torch.long, device=device)
        return SamplingMetadata(seq_groups, indices)


def _group_to_sample(metadata: SequenceGroupMetadata, query_len: int, token_offset: int,
                     selected: list[int]) -> SequenceGroupToSample:
    """Append this group's rows to `selected` and describe them (rows index `selected`)."""
    params = metadata.sampling_params
    seq_ids = list(metadata.seq_data)
    prompt_logprob_indices: list[int] = []
    prompt_logprob_token_ids: list[int] = []
    if metadata.is_prompt and params.prompt_logprobs is not None:
        # The hidden state at position t predicts token t + 1; only prompt tokens count
        # (a recompute after preemption also prefills already generated tokens).
        data = metadata.seq_data[seq_ids[0]]
        start = data.num_computed_tokens
        tokens = data.get_token_ids()
        for position in range(start, min(start + query_len, data.get_prompt_len() - 1)):
            prompt_logprob_indices.append(len(selected))
            prompt_logprob_token_ids.append(tokens[position + 1])
            selected.append(token_offset + position - start)
    sample_indices: list[int] = []
    if metadata.do_sample:
        for i in range(len(seq_ids)):
            sample_indices.append(len(selected))
            # The last new token of each sequence predicts its next token.
            selected.append(token_offset + (i + 1) * query_len - 1)
    return SequenceGroupToSample(metadata.request_id, seq_ids, params, metadata.seq_data,
                                 metadata.is_prompt, metadata.do_sample, prompt_logprob_indices,
                                 prompt_logprob_token_ids, sample_indices)


def sampled_seq_ids(group: SequenceGroupToSample) -> list[int]:
    """The sequences of `group` that get a sample row this step, in row order."""
    return group.seq_ids[: len(group.sample_indices)] if group.do_sample else []


def has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


@dataclass
class SamplingTensors:
    """The sampling parameters of each sample row (`sampled_seq_ids` of every group, in order)
    on the device (vLLM v0's name), built once per batch, reused by each step of a multi-step run.

    temperature, top_p, min_p `[rows]` fp32 (0 = greedy; 1.0, 0.0 = off); top_k `[rows]` int64
    (-1 = off); seeds (the request's or fresh), offsets (the position drawn) `[rows]` int64;
    needs_truncation, num_candidates: the sampling kernel's host-side hints. Penalties `[rows]`
    fp32, prompt_mask `[rows, vocab]` bool, output_counts `[rows, vocab]` fp32: None unless a row
    has a penalty; min_tokens_left `[rows]` int64, stop_mask `[rows, vocab]` bool: likewise.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor
    needs_truncation: bool
    num_candidates: int | None
    num_logprobs: list[int | None]
    max_logprobs: int
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    min_tokens_left: torch.Tensor | None = None
    stop_mask: torch.Tensor | None = None

    @staticmethod
    def from_groups(groups: list[SequenceGroupToSample], vocab_size: int,
                    device: torch.device | str, token_stats: TokenStatsCache) -> SamplingTensors:
        """token_stats: where the penalties' token statistics live between steps."""
        rows = [(group, seq_id) for group in groups for seq_id in sampled_seq_ids(group)]
        params = [group.sampling_params for group, _ in rows]
        datas = [group.seq_data[seq_id] for group, seq_id in rows]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else -1 for p in params]
        fresh = fresh_seeds(len(params)).tolist()
        seeds = [p.seed % 2**63 if p.seed is not None else s for p, s in zip(params, fresh)]
        temperature, top_p, min_p = _fields_to_device(
            [[0.0 if g else p.temperature for p, g in zip(params, greedy)],
             [p.top_p for p in params], [p.min_p for p in params]], torch.float32, device)
        top_k_t, seeds_t, offsets = _fields_to_device(
            [top_k, seeds, [d.get_len() for d in datas]], torch.int64, device)
        truncating = [k != -1 or p.top_p < 1.0 or p.min_p > 0.0 for k, p in zip(top_k, params)]
        num_logprobs = [p.logprobs for p in params]
        t = SamplingTensors(
            temperature=temperature, top_k=top_k_t, top_p=top_p, min_p=min_p, seeds=seeds_t,
            offsets=offsets, needs_truncation=any(truncating),
            num_candidates=_num_candidates(top_k, truncating, vocab_size),
            num_logprobs=num_logprobs, max_logprobs=max((n for n in num_logprobs if n), default=0))
        if any(has_penalties(p) for p in params):  # else no [rows, vocab] tensors at all
            t.repetition_penalty, t.frequency_penalty, t.presence_penalty = _fields_to_device(
                [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                 [p.presence_penalty for p in params]], torch.float32, device)
            t.prompt_mask, t.output_counts = token_stats.rows(rows)
        t.min_tokens_left, t.stop_mask = _min_tokens(params, datas, vocab_size, device)
        return t


def _min_tokens(params: list[SamplingParams], datas: list[SequenceData], vocab_size: int, device):
    """`[rows]` int64 tokens left to min_tokens and `[rows, vocab]` bool the stop tokens of the
    rows short of it, or None, None when no row is."""
    left = [p.min_tokens - d.get_output_len() if p.all_stop_token_ids else 0
            for p, d in zip(params, datas)]
    if all(n <= 0 for n in left):
        return None, None
    stop_mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for row, (p, n) in enumerate(zip(params, left)):
        if n > 0:
            stop_mask[row, [i for i in p.all_stop_token_ids if i < vocab_size]] = True
    return to_device(torch.tensor(left, dtype=torch.int64), device), to_device(stop_mask, device)


# Candidates the sampling kernel keeps per row when some truncating row has no top-k: a top-p
# nucleus bigger than this is still exact, through the kernel's slower fallback.
_NUCLEUS_CANDIDATES = 1024
_TIE_SLACK = 32  # extra candidates past the largest top-k, for ties at the k-th value


def _num_candidates(top_k: list[int], truncating: list[bool], vocab_size: int) -> int | None:
    if not any(truncating):
        return None
    largest_k = max(top_k) + _TIE_SLACK
    if all(k != -1 for k, t in zip(top_k, truncating) if t):
        return min(vocab_size, largest_k)
    return min(vocab_size, max(largest_k, _NUCLEUS_CANDIDATES))


def _fields_to_device(fields: list[list], dtype: torch.dtype, device) -> torch.Tensor:
    """`[num_fields, rows]` in one copy. In memory the rows are padded to a multiple of 4, so
    every field starts 16 bytes aligned: Triton specializes a kernel on its pointers' alignment,
    and an unaligned field would compile the sampling kernels again mid-run."""
    tensor = torch.tensor(fields, dtype=dtype)
    num_rows = tensor.shape[1]
    return to_device(torch.nn.functional.pad(tensor, (0, -num_rows % 4)), device)[:, :num_rows]


def fresh_seeds(num_rows: int, generator: torch.Generator | None = None,
                device="cpu") -> torch.Tensor:
    """`[num_rows]` int64 seeds for unseeded rows, from torch's generator of `device` or the
    `generator` given (so `torch.manual_seed` makes a run reproducible)."""
    if generator is not None:
        seeds = torch.randint(0, 2**62, (num_rows,), generator=generator, device=generator.device)
        return seeds.to(device)
    return torch.randint(0, 2**62, (num_rows,), device=device)
