"""Which logits rows belong to which request, and how each request samples.

Mirrors `vllm/model_executor/sampling_metadata.py` (v0). The model runner flattens a batch
of requests into one token stream; only some of those tokens need logits:

    prefill chunk of a prompt   the last token, if the chunk reaches the end of the prompt
                                (`do_sample`), plus one row per prompt token when the request
                                asked for `prompt_logprobs`
    decode                      the single new token of every running sequence

`SamplingMetadata.selected_token_indices` picks those rows out of the hidden states (so the
LM head runs on a handful of rows, not on every prompt token), and each
`SequenceGroupToSample` says which of the selected rows are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import SequenceData, SequenceGroupMetadata


@dataclass
class SequenceGroupToSample:
    """One request's share of the logits.

    Attributes:
        request_id: the request.
        seq_ids: its running sequences, in the order their tokens appear in the batch.
        sampling_params: how to sample.
        seq_data: seq_id -> tokens (penalties and beam scores read these).
        is_prompt: this step prefills (a chunk of) the prompt.
        do_sample: this step produces a new token.
        prompt_logprob_indices: rows (of the selected logits) for prompt logprobs, in order.
        prompt_logprob_token_ids: the prompt token each of those rows predicts.
        sample_indices: rows to sample from: one per sequence, or one for a prompt.
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

    @property
    def is_first_sample(self) -> bool:
        """The request's first token: one prompt row fans out into `best_of` samples."""
        return self.is_prompt and all(d.get_output_len() == 0 for d in self.seq_data.values())


@dataclass
class SamplingMetadata:
    """Row selection for the whole batch.

    Attributes:
        seq_groups: one entry per scheduled request, in the batch's order.
        selected_token_indices: `[num_selected]` int64, rows of the hidden states that get logits.
    """

    seq_groups: list[SequenceGroupToSample]
    selected_token_indices: torch.Tensor

    @staticmethod
    def prepare(
        seq_group_metadata_list: list[SequenceGroupMetadata],
        query_lens: list[int],
        device: torch.device | str,
    ) -> "SamplingMetadata":
        """Build the row selection for a flattened batch.

        Args:
            seq_group_metadata_list: the scheduled groups, in batch order.
            query_lens: new tokens per group (each of its sequences computes that many).
            device: where `selected_token_indices` lives.
        """
        seq_groups: list[SequenceGroupToSample] = []
        selected: list[int] = []
        token_offset = 0  # where the current sequence's tokens start in the flat batch
        for metadata, query_len in zip(seq_group_metadata_list, query_lens):
            seq_groups.append(_group_to_sample(metadata, query_len, token_offset, selected))
            token_offset += query_len * len(metadata.seq_data)
        indices = torch.tensor(selected, dtype=torch.long, device=device)
        return SamplingMetadata(seq_groups, indices)


def _group_to_sample(
    metadata: SequenceGroupMetadata, query_len: int, token_offset: int, selected: list[int]
) -> SequenceGroupToSample:
    """Append this group's rows to `selected` and describe them (rows index `selected`)."""
    params = metadata.sampling_params
    seq_ids = list(metadata.seq_data)
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    if metadata.is_prompt and params.prompt_logprobs is not None:
        # The hidden state at position t predicts token t + 1; only prompt tokens count
        # (a recompute after preemption also prefills already generated tokens).
        data = metadata.seq_data[seq_ids[0]]
        start = data.num_computed_tokens
        tokens = data.get_token_ids()
        stop = min(start + query_len, data.get_prompt_len() - 1)
        for position in range(start, stop):
            prompt_rows.append(len(selected))
            prompt_targets.append(tokens[position + 1])
            selected.append(token_offset + position - start)
    sample_rows: list[int] = []
    if metadata.do_sample:
        for i in range(len(seq_ids)):
            sample_rows.append(len(selected))
            # The last new token of each sequence predicts its next token.
            selected.append(token_offset + (i + 1) * query_len - 1)
    return SequenceGroupToSample(
        request_id=metadata.request_id,
        seq_ids=seq_ids,
        sampling_params=params,
        seq_data=metadata.seq_data,
        is_prompt=metadata.is_prompt,
        do_sample=metadata.do_sample,
        prompt_logprob_indices=prompt_rows,
        prompt_logprob_token_ids=prompt_targets,
        sample_indices=sample_rows,
    )


@dataclass
class SamplingTensors:
    """How each sample row samples, as tensors on the device (vLLM v0's `SamplingTensors`).

    Built once per batch (`from_groups`) with one copy to the device, and reused by every
    step of a multi-step run. Row i is the i-th group given (one sequence each).

    Attributes:
        temperature, top_p, min_p: `[rows]` fp32 (0 = greedy; 1.0 = off; 0.0 = off).
        top_k: `[rows]` int64 (-1 = off).
        seeds: `[rows]` int64: the request's seed, or a fresh random one for unseeded rows.
        offsets: `[rows]` int64: the position of the token being drawn (the sequence's length).
        needs_truncation: whether any row has top-k, top-p or min-p (a host-side fact, so the
            kernel need not look). num_candidates: the kernel's candidates per row then.
        num_logprobs: per row, `SamplingParams.logprobs` (host list); max_logprobs their max.
        repetition_penalty, frequency_penalty, presence_penalty: `[rows]` fp32, and
        prompt_mask: `[rows, vocab]` bool, output_counts: `[rows, vocab]` fp32 — all None
            unless some row has a penalty.
        min_tokens_left: `[rows]` int64, stop_mask: `[rows, vocab]` bool (the stop tokens of
            rows still short of min_tokens) — None unless some row needs them.
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
    def from_groups(groups: list[SequenceGroupToSample], vocab_size: int, device: torch.device | str,
                    token_stats: "TokenStatsCache") -> "SamplingTensors":
        """One row per sample row of the groups (`sample_rows`). token_stats: where the
        penalties' per-sequence token statistics are kept between steps."""
        rows = sample_rows(groups)
        params = [g.sampling_params for g, _ in rows]
        datas = [g.seq_data[seq_id] for g, seq_id in rows]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else -1 for p in params]
        fresh = fresh_seeds(len(params)).tolist()
        seeds = [p.seed % 2**63 if p.seed is not None else s for p, s in zip(params, fresh)]
        floats = torch.tensor([[0.0 if g else p.temperature for p, g in zip(params, greedy)],
                               [p.top_p for p in params], [p.min_p for p in params]], dtype=torch.float32)
        ints = torch.tensor([top_k, seeds, [d.get_len() for d in datas]], dtype=torch.int64)
        floats, ints = _to(_pad_rows(floats), device)[:, :len(params)], _to(_pad_rows(ints), device)[:, :len(params)]
        truncating = [k != -1 or p.top_p < 1.0 or p.min_p > 0.0 for k, p in zip(top_k, params)]
        num_logprobs = [p.logprobs for p in params]
        tensors = SamplingTensors(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0], seeds=ints[1],
            offsets=ints[2], needs_truncation=any(truncating),
            num_candidates=_num_candidates(top_k, truncating, vocab_size) if any(truncating) else None,
            num_logprobs=num_logprobs, max_logprobs=max((n for n in num_logprobs if n), default=0))
        _add_penalties(tensors, rows, device, token_stats)
        _add_min_tokens(tensors, params, datas, vocab_size, device)
        return tensors


# Candidates the sampling kernel keeps per row when some truncating row has no top-k: a
# top-p nucleus bigger than this is still exact, through the kernel's slower fallback.
_NUCLEUS_CANDIDATES = 1024
_TIE_SLACK = 32  # extra candidates past the largest top-k, for ties at the k-th value


def _num_candidates(top_k: list[int], truncating: list[bool], vocab_size: int) -> int:
    largest_k = max(top_k) + _TIE_SLACK
    if all(k != -1 for k, t in zip(top_k, truncating) if t):
        return min(vocab_size, largest_k)
    return min(vocab_size, max(largest_k, _NUCLEUS_CANDIDATES))


def fresh_seeds(num_rows: int, generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
    """`[num_rows]` int64 seeds for unseeded rows on `device`, from torch's generator of that
    device or the `generator` given (so `torch.manual_seed` makes a run reproducible)."""
    if generator is not None:
        return torch.randint(0, 2**62, (num_rows,), generator=generator, device=generator.device).to(device)
    return torch.randint(0, 2**62, (num_rows,), device=device)


def _pad_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`[fields, rows]` padded to a multiple of 4 rows, so that every field's row (a view into
    one copy) starts 16 bytes aligned whatever the batch size: Triton specializes a kernel on
    its pointers' 16-byte alignment, so an unaligned field would compile the sampling kernels
    again in the middle of a run."""
    return torch.nn.functional.pad(tensor, (0, -tensor.shape[1] % 4))


def _to(tensor: torch.Tensor, device) -> torch.Tensor:
    """One copy to the device, from pinned memory on a GPU (so it does not stall the host)."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def sample_rows(groups: list[SequenceGroupToSample]) -> list[tuple[SequenceGroupToSample, int]]:
    """(group, sequence id) of each sample row, in order: one per sequence of a decode, one
    for a prompt (whose sequence continues its prompt)."""
    return [(group, seq_id) for group in groups for seq_id in sampled_seq_ids(group)]


def sampled_seq_ids(group: SequenceGroupToSample) -> list[int]:
    """The sequences of `group` that get a sample row this step (none if it does not sample)."""
    return group.seq_ids[: len(group.sample_indices)] if group.do_sample else []


def _add_penalties(t: SamplingTensors, rows: list[tuple[SequenceGroupToSample, int]], device,
                   token_stats: "TokenStatsCache") -> None:
    params = [g.sampling_params for g, _ in rows]
    if all(p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
           for p in params):
        return  # the common case: no [rows, vocab] tensors at all
    penalties = torch.tensor([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                              [p.presence_penalty for p in params]], dtype=torch.float32)
    t.repetition_penalty, t.frequency_penalty, t.presence_penalty = _to(_pad_rows(penalties), device)[:, :len(params)]
    t.prompt_mask, t.output_counts = token_stats.rows(rows)


class TokenStatsCache:
    """The penalties' token statistics of each sequence, kept on the device between steps:
    which tokens its prompt holds (`[vocab]` bool) and how often each appears in its output
    (`[vocab]` fp32), one row of a pool per sequence.

    Building them from the token lists every step costs the host a pass over every token of
    the batch (~250k at 256 requests of 1,000 tokens); here a request's prompt is read once,
    and each step adds only the output tokens that are new since its last step. The pool
    doubles when full and never shrinks: it keeps the most sequences with penalties that ran
    at once (5 bytes per vocabulary entry each: 0.76 MB for Qwen3's 151,936 tokens).
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, device=device)
        self.slots: dict[tuple[str, int], int] = {}  # (request id, sequence id) -> its pool row
        self.num_counted: dict[tuple[str, int], int] = {}  # ... -> output tokens already counted
        self.free_slots: list[int] = []

    def rows(self, rows: list[tuple[SequenceGroupToSample, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`[rows, vocab]` prompt masks and output counts of these (group, sequence id) rows
        (copies: a multi-step run may add to its counts without touching the pool)."""
        prompt_rows, prompt_tokens, count_rows, count_tokens = [], [], [], []
        for group, seq_id in rows:
            key, data = (group.request_id, seq_id), group.seq_data[seq_id]
            if key not in self.slots:
                slot = self._allocate(key)
                prompt_rows += [slot] * data.get_prompt_len()
                prompt_tokens += data.prompt_token_ids
            slot, start = self.slots[key], self.num_counted[key]
            new_tokens = data.output_token_ids[start:]
            count_rows += [slot] * len(new_tokens)
            count_tokens += new_tokens
            self.num_counted[key] = start + len(new_tokens)
        if prompt_tokens:
            self.prompt_mask[self._index(prompt_rows), self._index(prompt_tokens)] = True
        if count_tokens:
            ones = torch.ones(len(count_tokens), device=self.device)
            self.output_counts.index_put_((self._index(count_rows), self._index(count_tokens)), ones, accumulate=True)
        slots = self._index([self.slots[(group.request_id, seq_id)] for group, seq_id in rows])
        return self.prompt_mask[slots], self.output_counts[slots]

    def release(self, request_ids: list[str]) -> None:
        """Give back the rows of (every sequence of) requests that ended."""
        ended = set(request_ids)
        self._free([key for key in self.slots if key[0] in ended])

    def release_dropped_sequences(self, request_id: str, live_seq_ids: set[int]) -> None:
        """Give back the rows of a running request's sequences that are gone (beam search
        replaces its beams by new sequences every step; the request itself runs on)."""
        self._free([key for key in self.slots if key[0] == request_id and key[1] not in live_seq_ids])

    def _free(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            self.free_slots.append(self.slots.pop(key))
            del self.num_counted[key]

    def _allocate(self, key: tuple[str, int]) -> int:
        if not self.free_slots:  # grow the pool: double it (rows are copied once per doubling)
            old = self.prompt_mask.shape[0]
            new = max(2 * old, 16)
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(new - old, self.vocab_size)])
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
            self.free_slots = list(range(new - 1, old - 1, -1))
        slot = self.free_slots.pop()
        self.prompt_mask[slot] = False
        self.output_counts[slot] = 0
        self.slots[key], self.num_counted[key] = slot, 0
        return slot

    def _index(self, values: list[int]) -> torch.Tensor:
        return _to(torch.tensor(values, dtype=torch.int64), self.device)


def token_counts(token_lists: list, vocab_size: int, device) -> torch.Tensor:
    """`[rows, vocab_size]` fp32 counts of each token id in each row's list: one padded copy
    to the device and one scatter (padding goes to an extra column that is dropped)."""
    max_len = max((len(tokens) for tokens in token_lists), default=0)
    padded = torch.full((len(token_lists), max(max_len, 1)), vocab_size, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    padded = _to(padded, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size].contiguous()


def _add_min_tokens(t: SamplingTensors, params: list[SamplingParams], datas: list[SequenceData],
                    vocab_size: int, device) -> None:
    left = [p.min_tokens - d.get_output_len() if p.all_stop_token_ids else 0 for p, d in zip(params, datas)]
    if all(n <= 0 for n in left):
        return
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for row, (p, n) in enumerate(zip(params, left)):
        if n > 0:
            mask[row, [i for i in p.all_stop_token_ids if i < vocab_size]] = True
    t.stop_mask = _to(mask, device)
    t.min_tokens_left = _to(torch.tensor(left, dtype=torch.int64), device)
