"""The sampling spec as two layers: `SampleTokens` and `ApplyPenalties` (`CustomOp`s).

    forward_native   `kernels/reference.py`: the PyTorch spec, what runs on a CPU
    forward_triton   `kernels/sampling.py`: the same contract in Triton kernels, on a GPU

Every path that draws a token reaches the spec through these two: the `Sampler` (and its
`DeviceSampler`), parallel sampling and beam search, and speculative decoding's
`RejectionSampler`. There is one random-number scheme: a row's draw is arg-max(z + noise),
the noise a function of (seed, offset, token id) alone, so no generator state is kept and a
seeded request's tokens do not depend on its batch.
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

    def draw(self, weights: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """`[rows]` token ids, token x drawn with probability weights[x] / sum(weights) (`[rows,
        vocab]` non-negative, not necessarily normalised; a zero weight is never drawn)."""
        rows = weights.shape[0]
        ones = torch.ones(rows, device=weights.device)
        no_top_k = torch.full((rows,), -1, dtype=torch.int64, device=weights.device)
        tokens, _ = self(weights.float().log().contiguous(), ones, no_top_k, ones, torch.zeros_like(ones),
                         seeds.to(weights.device), torch.zeros_like(no_top_k), needs_truncation=False)
        return tokens


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

