"""Speculative decoding's acceptance step: `RejectionSampler`.

Mirrors `vllm/model_executor/layers/rejection_sampler.py` (v0): "speculative sampling"
(Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2). For one sequence, with
draft tokens d_1..d_k drawn from the proposer's q_1..q_k and the target's p_1..p_{k+1}:

    for i = 1..k:
        accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
        on the first rejection: emit one token from norm(max(0, p_i - q_i)) and stop
    all k accepted: emit a "bonus" token from p_{k+1}

Each emitted token is distributed exactly as p (notebook 18 works it out). A deterministic
proposer (n-gram) has q = one-hot(d) (`draft_probs=None`); a greedy request has p =
one-hot(argmax), so its output is token-identical to decoding without speculation. Every
random number is `RaceNoise`'s (the one random-number scheme): one call per step, a fresh
seed per sequence, gives the last token's race over the vocabulary and, past it, k uniforms
that decide the drafts.
"""

from __future__ import annotations

import torch

from minivllm.model_executor.layers.sampling_ops import RaceNoise, race, uniform
from minivllm.model_executor.sampling_metadata import fresh_seeds

# Output id of a position after the first rejection (vLLM uses -1 too).
NO_TOKEN = -1


class RejectionSampler:
    """Accept a prefix of each sequence's draft tokens and emit one more token after it.

    Stateless: the counts for metrics are computed from the output (`num_emitted`).

    Args:
        backend: "torch" or "triton", the sampling ops' backend (the model's).
    """

    def __init__(self, backend: str = "torch") -> None:
        self.race_noise = RaceNoise(backend)

    def __call__(
        self,
        target_probs: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_proposed: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """
        Args:
            target_probs: `[batch, k + 1, vocab]` fp32, the target's distribution at each
                scored position (row i of a sequence predicts the token after its i-th input).
                Rows past a sequence's `num_proposed` are never read.
            draft_token_ids: `[batch, k]` int64 proposals (entries past `num_proposed` ignored).
            num_proposed: `[batch]` int64, how many of the k proposals are real (0..k).
            draft_probs: `[batch, k, vocab]` fp32, the proposer's distributions q_i, or None for
                a deterministic proposer (q_i = one-hot of the proposal).
            generator: where the draws' fresh seeds come from (None: torch's; tests fix it).
        Returns:
            `[batch, k + 1]` int64: accepted drafts, then the recovered or bonus token, then
            `NO_TOKEN`. Sequence b emits `num_emitted(output)[b]` = accepted + 1 tokens.
        """
        batch, k = draft_token_ids.shape
        device = target_probs.device
        positions = torch.arange(k, device=device)
        is_real = positions.unsqueeze(0) < num_proposed.unsqueeze(1)  # [batch, k]
        drafts = torch.where(is_real, draft_token_ids, 0)
        p_draft = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        vocab_size = target_probs.shape[2]
        seeds = fresh_seeds(batch, generator, device)
        # One stream per sequence: the last token's race over the vocabulary, then k values past
        # it for the uniforms that decide the drafts.
        noise = self.race_noise(seeds, torch.zeros_like(seeds), vocab_size + k)
        # u < p / q, written without the division (q = 0 would be a proposal the proposer
        # could not make; then the draft is accepted iff p > 0).
        accepted = (uniform(noise[:, vocab_size:]) * q_draft < p_draft) & is_real
        # The first rejected (or missing) position: accepted tokens form a prefix.
        num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # [batch]
        weights = self._recover(target_probs, drafts, draft_probs, num_accepted, num_proposed)
        last = race(weights, noise[:, :vocab_size])
        output = torch.where(positions.unsqueeze(0) < num_accepted.unsqueeze(1), drafts, NO_TOKEN)
        output = torch.cat([output, torch.full((batch, 1), NO_TOKEN, dtype=torch.long, device=device)], dim=1)
        return output.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))

    @staticmethod
    def greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
        """`__call__`'s output for one greedy sequence, from the target's arg-max alone.

        p is one-hot at the arg-max, so a draft is accepted iff it equals it (whatever q is),
        and the token after the accepted prefix is the arg-max there too: no draws and no
        distributions, so it runs on the host (vLLM v1's sampler has a greedy path too).

            target  [5, 9, 2, 7]   the arg-max at the k + 1 scored positions
            drafts  [5, 9, 4]      -> [5, 9, 2]: two accepted, then the target's token
        """
        accepted = 0
        while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
            accepted += 1
        return target_token_ids[: accepted + 1]

    @staticmethod
    def _recover(target_probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                 num_accepted: torch.Tensor, num_proposed: torch.Tensor) -> torch.Tensor:
        """`[batch, vocab]` weights of the token after the accepted prefix: (p - q)+ where a
        draft was rejected, p itself (the bonus token) where every proposal was accepted."""
        rows = torch.arange(drafts.shape[0], device=drafts.device)
        p = target_probs[rows, num_accepted]  # [batch, vocab]
        rejected = num_accepted < num_proposed
        at = num_accepted.clamp(max=max(drafts.shape[1] - 1, 0))
        if draft_probs is None:
            q = torch.zeros_like(p)
            if drafts.shape[1]:
                q.scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
        else:
            q = draft_probs[rows, at] if drafts.shape[1] else torch.zeros_like(p)
        residual = torch.where(rejected.unsqueeze(1), (p - q).clamp_(min=0.0), p)
        # Rounding can leave a residual of all zeros (p == q in fp32): then p itself is right.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        return torch.where(empty, p, residual)


def num_emitted(output_token_ids: torch.Tensor) -> torch.Tensor:
    """`[batch]` tokens each sequence emits: its accepted drafts plus one."""
    return (output_token_ids != NO_TOKEN).sum(dim=1)
