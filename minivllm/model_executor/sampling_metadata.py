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
        generator: the request's seeded random generator (None: the global one).
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
    generator: torch.Generator | None = None

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
        generators: dict[str, torch.Generator] | None = None,
    ) -> "SamplingMetadata":
        """Build the row selection for a flattened batch.

        Args:
            seq_group_metadata_list: the scheduled groups, in batch order.
            query_lens: new tokens per group (each of its sequences computes that many).
            device: where `selected_token_indices` lives.
            generators: request_id -> seeded generator, created here on first sight.
        """
        generators = {} if generators is None else generators
        seq_groups: list[SequenceGroupToSample] = []
        selected: list[int] = []
        token_offset = 0  # where the current sequence's tokens start in the flat batch
        for metadata, query_len in zip(seq_group_metadata_list, query_lens):
            group = _group_to_sample(metadata, query_len, token_offset, selected)
            group.generator = _get_generator(metadata, generators, device)
            seq_groups.append(group)
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


def _get_generator(
    metadata: SequenceGroupMetadata,
    generators: dict[str, torch.Generator],
    device: torch.device | str,
) -> torch.Generator | None:
    params = metadata.sampling_params
    if params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    if metadata.request_id not in generators:
        # One generator per request, kept across steps (and preemptions): the same seed
        # gives the same tokens whatever else shares the batch.
        generators[metadata.request_id] = torch.Generator(device=device).manual_seed(params.seed)
    return generators[metadata.request_id]
