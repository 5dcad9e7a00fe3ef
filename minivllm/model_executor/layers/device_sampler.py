"""Sampling that leaves its tokens on the device: `DeviceSampler`, for the multi-step runner.

The plain `Sampler` hands the engine Python objects (`SequenceOutput`s), so every step ends
with a device-to-host copy and a sync. A multi-step run instead feeds each step's tokens
straight into the next forward pass; only requests whose next token depends on the logits
alone can run that way (greedy, or random without a seed: no logprobs, penalties or
pending `min_tokens`, one sequence). `DeviceSampler` serves exactly those, with the plain
sampler's own logits processing and token choice, returning tensors.
"""

from __future__ import annotations

import torch

from minivllm.model_executor.layers.sampler import Sampler, choose_tokens, needs_nothing_per_token, process_logits
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import SequenceData

_DEVICE_SAMPLING_TYPES = (SamplingType.GREEDY, SamplingType.RANDOM)


class DeviceSampler:
    """Wraps a plain `Sampler` (for its backend's greedy pick)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    @staticmethod
    def can_sample(params: SamplingParams, seq_datas: list[SequenceData]) -> bool:
        """Whether a decoding request's next token can be drawn with no host work."""
        return params.sampling_type in _DEVICE_SAMPLING_TYPES and needs_nothing_per_token(params, seq_datas)

    def __call__(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`[rows, vocab]` logits (any float dtype) -> `[rows]` token ids and their logprobs,
        left on the device (no host sync). Every request must pass `can_sample`."""
        groups = sampling_metadata.seq_groups
        if all(g.sampling_params.sampling_type == SamplingType.GREEDY for g in groups):
            return self.sampler.greedy_sample(logits)  # (the kernel accumulates in fp32)
        sample_logits = process_logits(logits.float(), groups)
        tokens = choose_tokens(sample_logits, groups)
        token_logprobs = torch.log_softmax(sample_logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, token_logprobs
