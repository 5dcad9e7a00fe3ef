"""The sampling spec as layers (`CustomOp`s): `forward_native` calls `kernels/reference.py`,
the PyTorch spec that runs on a CPU, `forward_triton` the same contract's Triton kernels
(`kernels/sampling.py`). Every token drawn goes through them: `SampleTokens` for the `Sampler`,
parallel sampling and beam search; `RaceNoise`, the noise `SampleTokens` adds (a function of
(seed, offset, token id) alone), for speculative decoding's `RejectionSampler` and proposer.
"""

from __future__ import annotations

import torch

from minivllm.kernels import reference
from minivllm.model_executor.custom_op import CustomOp


class SampleTokens(CustomOp):
    """`(logits [rows, vocab], temperature, top_k, top_p, min_p, seeds, offsets [rows], *,
    needs_truncation, num_candidates)` -> tokens `[rows]` int64, logprobs `[rows]` fp32."""

    def forward_native(self, *args, **hints) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.sample_tokens(*args, **hints)

    def forward_triton(self, *args, **hints) -> tuple[torch.Tensor, torch.Tensor]:
        from minivllm.kernels import sampling  # imports triton: only once this backend is chosen

        return sampling.sample_tokens(*args, **hints)


class ApplyPenalties(CustomOp):
    """`(logits [rows, vocab], prompt_mask, output_counts [rows, vocab], repetition, frequency,
    presence [rows])` -> new `[rows, vocab]` fp32 logits."""

    def forward_native(self, *args) -> torch.Tensor:
        return reference.apply_penalties(*args)

    def forward_triton(self, *args) -> torch.Tensor:
        from minivllm.kernels import sampling

        return sampling.apply_penalties(*args)


class RaceNoise(CustomOp):
    """`(seeds [rows], offsets [rows], num_tokens)` -> `[rows, num_tokens]` fp32, the noise
    `SampleTokens` adds to z for token ids 0..num_tokens - 1."""

    def forward_native(self, *args) -> torch.Tensor:
        return reference.race_noise(*args)

    def forward_triton(self, *args) -> torch.Tensor:
        from minivllm.kernels import sampling

        return sampling.race_noise(*args)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`[rows]` token ids, token x drawn with probability weights[x] / sum(weights) (`[rows,
    vocab]` non-negative, not necessarily normalised) given the race's `[rows, vocab]` noise.
    The noise is finite, so a zero weight's score stays -inf."""
    return weights.float().log().add_(noise).argmax(dim=1)


def uniform(noise: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) from the race's noise: exp(-E) of its E ~ Exp(1) = exp(-noise)."""
    return torch.exp(-torch.exp(-noise))
