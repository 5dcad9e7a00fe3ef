"""The plain sampling path, the tokens left on the device: `DeviceSampler`.

One batch, `[rows, vocab]` logits (one row per sequence), `SamplingTensors` built once:

    min_tokens     stop tokens masked while a row is short of `min_tokens`
    penalties      `ApplyPenalties` over the rows' token statistics (`TokenStatsCache`)
    temperature, top-k, top-p, min-p, the draw and its logprob     `SampleTokens`, one call
    top-N logprobs and the chosen token's rank    only for rows that asked

Both ops are `sampling_ops`' CustomOps (the spec in `kernels/reference.py`, Triton on a GPU).
A seeded row's noise is a function of (seed, position, token id), so its tokens do not depend
on its batch or on single- vs multi-step; unseeded rows get a fresh seed per batch from
torch's generator. `step` lets the multi-step runner feed each step's tokens straight into the
next forward pass (positions, counts and min_tokens advance on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model_executor.layers.sampling_ops import ApplyPenalties, SampleTokens
from minivllm.model_executor.sampling_metadata import SamplingTensors, SequenceGroupToSample, sampled_seq_ids
from minivllm.model_executor.token_stats import TokenStatsCache
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import SequenceData, SequenceOutput


@dataclass
class DeviceSample:
    """One step's draws, on the device. tokens, logprobs, ranks: `[rows]`; top_ids and
    top_logprobs: `[rows, max_logprobs]` (None when no row asked for logprobs)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self, non_blocking: bool = False) -> "DeviceSample":
        """Copies in (pinned, when on a GPU) host memory; with non_blocking, wait on an event
        recorded after this call before reading them."""
        def copy(tensor):
            if tensor is None or tensor.device.type != "cuda":
                return tensor
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=non_blocking)

        return DeviceSample(*(copy(t) for t in (self.tokens, self.logprobs, self.ranks, self.top_ids,
                                                   self.top_logprobs)))

    def sequence_outputs(self, groups: list[SequenceGroupToSample], t: SamplingTensors) -> list[list[SequenceOutput]]:
        """Each group's `SequenceOutput`s, one per sample row (host tensors: `to_host` first)."""
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        ranks = self.ranks.tolist() if self.ranks is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        outputs: list[list[SequenceOutput]] = [[] for _ in groups]
        row = 0  # rows run through the groups in order (`sample_rows`)
        for index, group in enumerate(groups):
            for seq_id in sampled_seq_ids(group):
                token = tokens[row]
                entry = {token: logprobs[row]}
                rank = None
                num_logprobs = t.num_logprobs[row]
                if num_logprobs is not None:
                    rank = ranks[row]
                    for top_token, value in zip(top_ids[row][:num_logprobs], top_values[row][:num_logprobs]):
                        entry.setdefault(top_token, value)
                outputs[index].append(SequenceOutput(seq_id, token, entry, rank))
                row += 1
        return outputs


class DeviceSampler:
    """Samples one row per sequence on the logits' device (module docstring).

    Args:
        backend: "torch" (the PyTorch reference) or "triton" (the kernel), as the model's.
    """

    def __init__(self, backend: str = "torch") -> None:
        self.sample_tokens = SampleTokens(backend)
        self.apply_penalties = ApplyPenalties(backend)
        self.token_stats: TokenStatsCache | None = None  # made on the first request with penalties

    def prepare(self, groups: list[SequenceGroupToSample], vocab_size: int, device) -> SamplingTensors:
        """The batch's `SamplingTensors` (penalty statistics from this sampler's cache)."""
        if self.token_stats is None:
            self.token_stats = TokenStatsCache(vocab_size, device)
        return SamplingTensors.from_groups(groups, vocab_size, device, self.token_stats)

    def release(self, request_ids: list[str]) -> None:
        """Forget the token statistics of requests that ended."""
        if self.token_stats is not None:
            self.token_stats.release(request_ids)

    @staticmethod
    def can_sample(params: SamplingParams, seq_datas: list[SequenceData]) -> bool:
        """One sequence, one sample, no beams and no Python logits processors (what the
        multi-step runner needs)."""
        return (len(seq_datas) == 1 and params.best_of == 1 and params.sampling_type != SamplingType.BEAM
                and not params.logits_processors)

    @staticmethod
    def depends_on_logits_alone(params: SamplingParams, seq_datas: list[SequenceData]) -> bool:
        """Whether the next token is a function of the logits alone: greedy or unseeded random,
        no logprobs, no penalties, no pending min_tokens (what speculative decoding's rejection
        sampler can stand in for)."""
        return (params.sampling_type in (SamplingType.GREEDY, SamplingType.RANDOM)
                and DeviceSampler.can_sample(params, seq_datas) and params.logprobs is None
                and not _has_penalties(params)
                and (params.min_tokens == 0 or seq_datas[0].get_output_len() >= params.min_tokens))

    def __call__(self, logits: torch.Tensor, t: SamplingTensors, step: int = 0) -> DeviceSample:
        """Draw one token per row.

        Args:
            logits: `[rows, vocab]` (any float dtype), row i for `t`'s row i.
            t: the batch's sampling tensors (`SamplingTensors.from_groups`).
            step: decode steps already taken since `t` was built (multi-step): positions,
                pending min_tokens and, through `record`, the token counts follow it.
        """
        logits = self.process(logits, t, step)
        tokens, logprobs = self.sample_tokens(logits, t.temperature, t.top_k, t.top_p, t.min_p, t.seeds,
                                              t.offsets + step, needs_truncation=t.needs_truncation,
                                              num_candidates=t.num_candidates)
        if all(n is None for n in t.num_logprobs):
            return DeviceSample(tokens, logprobs)
        return DeviceSample(tokens, logprobs, *_top_logprobs(logits, t, tokens, logprobs))

    @staticmethod
    def record(t: SamplingTensors, tokens: torch.Tensor) -> None:
        """Count this step's tokens, for the penalties of the next step (multi-step)."""
        if t.output_counts is not None:
            t.output_counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(tokens, dtype=t.output_counts.dtype).unsqueeze(1))

    def process(self, logits: torch.Tensor, t: SamplingTensors, step: int = 0) -> torch.Tensor:
        """Penalties and min_tokens, in fp32 (only where some row needs them: else untouched)."""
        if t.stop_mask is not None:
            pending = (t.min_tokens_left > step).unsqueeze(1)
            logits = logits.float().masked_fill(t.stop_mask & pending, -float("inf"))
        if t.output_counts is not None:
            logits = self.apply_penalties(logits, t.prompt_mask, t.output_counts, t.repetition_penalty,
                                          t.frequency_penalty, t.presence_penalty)
        return logits


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _top_logprobs(logits: torch.Tensor, t: SamplingTensors, tokens: torch.Tensor, logprobs: torch.Tensor):
    """Ranks `[rows]`, and the `max_logprobs` most likely tokens and their logprobs, in the
    distribution that was sampled from (z over the kept set; outside it -inf)."""
    from minivllm.kernels import reference

    z = logits.float() / torch.where(t.temperature == 0, 1.0, t.temperature).unsqueeze(1)
    chosen_z = z.gather(1, tokens.unsqueeze(1))
    ranks = (z > chosen_z).sum(dim=-1) + 1
    top_z, top_ids = torch.topk(z, t.max_logprobs, dim=-1)
    log_normalizer = chosen_z - logprobs.unsqueeze(1)  # logsumexp over the kept set
    top_logprobs = top_z - log_normalizer
    if t.needs_truncation:
        kept = reference.kept_mask(z, t.top_k, t.top_p, t.min_p).gather(1, top_ids)
        top_logprobs = top_logprobs.masked_fill(~kept, -float("inf"))
    return ranks, top_ids, top_logprobs
