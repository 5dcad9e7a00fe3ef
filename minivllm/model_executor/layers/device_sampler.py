"""Steps 1-6 of the `Sampler` for the whole batch on the logits' device, the tokens left there:
`DeviceSampler`, vLLM v0's `_sample` over `SamplingTensors` (closer to V1's GPU sampler).

min_tokens is a stop-token mask, the penalties one `ApplyPenalties` call over the rows' token
statistics (`TokenStatsCache`), steps 3-6 one `SampleTokens` call; top-N logprobs and ranks only
for rows that asked (`logprobs.py`). Multi-step feeds each step's tokens to the next forward
pass: `step` advances positions and pending min_tokens, `record` counts the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model_executor.layers.logprobs import top_logprobs
from minivllm.model_executor.layers.sampling_ops import ApplyPenalties, SampleTokens
from minivllm.model_executor.sampling_metadata import (SamplingTensors, SequenceGroupToSample,
                                                      has_penalties, sampled_seq_ids)
from minivllm.model_executor.token_stats import TokenStatsCache
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import SequenceData, SequenceOutput


@dataclass
class DeviceSample:
    """One step's draws. tokens, logprobs, ranks: `[rows]`; top_ids, top_logprobs: `[rows,
    max_logprobs]` (ranks and the top-N: None when no row asked for logprobs)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self, non_blocking: bool = False) -> DeviceSample:
        """Pinned host copies; non_blocking: read them once an event recorded after this is done."""
        def copy(tensor):
            if tensor is None or tensor.device.type != "cuda":
                return tensor
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=non_blocking)

        return DeviceSample(**{name: copy(tensor) for name, tensor in vars(self).items()})

    def sequence_outputs(self, groups: list[SequenceGroupToSample],
                         t: SamplingTensors) -> list[list[SequenceOutput]]:
        """Each group's `SequenceOutput`s, one per sample row (host tensors: `to_host` first)."""
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        if self.ranks is not None:
            ranks, top_ids = self.ranks.tolist(), self.top_ids.tolist()
            top_values = self.top_logprobs.tolist()
        outputs: list[list[SequenceOutput]] = []
        row = 0  # rows run through the groups in order (`sampled_seq_ids`)
        for group in groups:
            outputs.append([])
            for seq_id in sampled_seq_ids(group):
                entry, rank = {tokens[row]: logprobs[row]}, None
                num_logprobs = t.num_logprobs[row]
                if num_logprobs is not None:
                    rank = ranks[row]
                    top = zip(top_ids[row][:num_logprobs], top_values[row][:num_logprobs])
                    for top_token, value in top:
                        entry.setdefault(top_token, value)
                outputs[-1].append(SequenceOutput(seq_id, tokens[row], entry, rank))
                row += 1
        return outputs


class DeviceSampler:
    """backend: "torch" (the PyTorch spec) or "triton" (the kernels), the model's setting."""

    def __init__(self, backend: str = "torch") -> None:
        self.sample_tokens = SampleTokens(backend)
        self.apply_penalties = ApplyPenalties(backend)
        self.token_stats: TokenStatsCache | None = None  # made on the device of the first batch

    def prepare(self, groups: list[SequenceGroupToSample], vocab_size: int,
                device) -> SamplingTensors:
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
        """One sequence, one sample, no beams, no logits processors (what multi-step needs)."""
        return (len(seq_datas) == 1 and params.best_of == 1
                and params.sampling_type != SamplingType.BEAM and not params.logits_processors)

    @staticmethod
    def depends_on_logits_alone(params: SamplingParams, seq_datas: list[SequenceData]) -> bool:
        """Greedy or unseeded random, no logprobs, penalties or pending min_tokens: what
        speculative decoding's rejection sampler can stand in for."""
        return (params.sampling_type in (SamplingType.GREEDY, SamplingType.RANDOM)
                and DeviceSampler.can_sample(params, seq_datas) and params.logprobs is None
                and not has_penalties(params)
                and (params.min_tokens == 0 or seq_datas[0].get_output_len() >= params.min_tokens))

    def __call__(self, logits: torch.Tensor, t: SamplingTensors, step: int = 0) -> DeviceSample:
        """One token per row of logits `[rows, vocab]` (any float dtype). step: decode steps
        taken since `t` was built (multi-step)."""
        logits = self.process(logits, t, step)
        tokens, logprobs = self.sample_tokens(
            logits, t.temperature, t.top_k, t.top_p, t.min_p, t.seeds, t.offsets + step,
            needs_truncation=t.needs_truncation, num_candidates=t.num_candidates)
        if all(n is None for n in t.num_logprobs):
            return DeviceSample(tokens, logprobs)
        return DeviceSample(tokens, logprobs, *top_logprobs(logits, t, tokens, logprobs))

    @staticmethod
    def record(t: SamplingTensors, tokens: torch.Tensor) -> None:
        """Count this step's tokens, for the penalties of the next step (multi-step)."""
        if t.output_counts is not None:
            ones = torch.ones_like(tokens, dtype=t.output_counts.dtype)
            t.output_counts.scatter_add_(1, tokens.unsqueeze(1), ones.unsqueeze(1))

    def process(self, logits: torch.Tensor, t: SamplingTensors, step: int = 0) -> torch.Tensor:
        """min_tokens and penalties, in fp32 (only where some row needs them: else untouched)."""
        if t.stop_mask is not None:
            pending = (t.min_tokens_left > step).unsqueeze(1)
            logits = logits.float().masked_fill(t.stop_mask & pending, -float("inf"))
        if t.output_counts is not None:
            penalties = (t.repetition_penalty, t.frequency_penalty, t.presence_penalty)
            logits = self.apply_penalties(logits, t.prompt_mask, t.output_counts, *penalties)
        return logits
