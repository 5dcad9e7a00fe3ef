"""The sampling spec as layers: `SampleTokens`, `ApplyPenalties` and `RaceNoise` (`CustomOp`s).

    forward_native   `kernels/reference.py`: the PyTorch spec, what runs on a CPU
    forward_triton   `kernels/sampling.py`: the same contract in Triton kernels, on a GPU

Every path that draws a token reaches the spec through these: the `Sampler` (and its
`DeviceSampler`), parallel sampling and beam search through `SampleTokens`; speculative
decoding's `RejectionSampler` and draft proposer through `RaceNoise`. There is one
random-number scheme: a row's draw is arg-max(z + noise), the noise a function of (seed,
offset, token id) alone, so no generator state is kept and a seeded request's tokens do not
depend on its batch.
"""

from __future__ import annotations

import torch

from minivllm.model_executor.custom_op import CustomOp


class SampleTokens(CustomOp):
    """`sample_tokens(logits [rows, vocab], temperature, top_k, top_p, min_p, seeds, offsets)`
    -> tokens `[rows]` int64 and their logprobs `[rows]` fp32 (contract: `reference.sample_tokens`)."""

    def forward_native(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
                       needs_truncation: bool | None = None, num_candidates: int | None = None):
        from minivllm.kernels import reference

        return reference.sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets)

    def forward_triton(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
                       needs_truncation: bool | None = None, num_candidates: int | None = None):
        from minivllm.kernels import sampling  # imports triton: only when this backend is chosen

        return sampling.sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets,
                                      needs_truncation=needs_truncation, num_candidates=num_candidates)


class ApplyPenalties(CustomOp):
    """`apply_penalties(logits [rows, vocab], prompt_mask, output_counts, repetition, frequency,
    presence)` -> new `[rows, vocab]` fp32 logits (contract: `reference.apply_penalties`)."""

    def forward_native(self, logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                       repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
        from minivllm.kernels import reference

        return reference.apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence)

    def forward_triton(self, logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                       repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
        from minivllm.kernels import sampling

        return sampling.apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence)



class RaceNoise(CustomOp):
    """`race_noise(seeds [rows], offsets [rows], num_tokens)` -> `[rows, num_tokens]` fp32, the
    noise `SampleTokens` adds to z for token ids 0..num_tokens - 1 (contract: `reference.race_noise`)."""

    def forward_native(self, seeds: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
        from minivllm.kernels import reference

        return reference.race_noise(seeds, offsets, num_tokens)

    def forward_triton(self, seeds: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
        from minivllm.kernels import sampling

        return sampling.race_noise(seeds, offsets, num_tokens)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`[rows]` token ids, token x drawn with probability weights[x] / sum(weights) (`[rows,
    vocab]` non-negative, not necessarily normalised) given the race's `[rows, vocab]` noise.
    The noise is finite, so a zero weight's score stays -inf."""
    return weights.float().log().add_(noise).argmax(dim=1)


def uniform(noise: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) from the race's noise: exp(-E) of its E ~ Exp(1) = exp(-noise)."""
    return torch.exp(-torch.exp(-noise))
