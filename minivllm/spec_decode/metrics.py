"""Speculative decoding's counts, with vLLM's names (`vllm/spec_decode/metrics.py`).

    draft_acceptance_rate = accepted_tokens / draft_tokens
    system_efficiency     = emitted_tokens / the most that could have been emitted
                            (k + 1 per sequence per speculative step: every draft accepted
                            plus the bonus token)

and one of minivllm's own, the acceptance rate of the papers' formulas:

    alpha = accepted_tokens / checked_tokens

A guess after the first rejected one is never checked, yet vLLM's draft_acceptance_rate
counts it as not accepted; Leviathan et al.'s alpha is the probability that a *checked* guess
is accepted, so `expected_tokens_per_step(alpha, k)` predicts the emitted tokens per step.

Plain Python (no torch): the engine's `Stats` and the Prometheus logger read it. Counts are
cumulative since the engine started, as vLLM's are; a logger that wants per-interval numbers
takes differences.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeWorkerMetrics:
    """A snapshot of the counts (tokens of sequences that speculated; rates are nan before any)."""

    draft_acceptance_rate: float
    system_efficiency: float
    draft_tokens: int
    emitted_tokens: int
    accepted_tokens: int
    num_spec_tokens: int
    checked_tokens: int = 0  # minivllm's: guesses the rejection sampler looked at

    @property
    def alpha(self) -> float:
        """Accepted / checked guesses: the papers' per-guess acceptance rate (nan before any)."""
        return _ratio(self.accepted_tokens, self.checked_tokens)


class AcceptanceCounter:
    """Accumulates one speculative step after another (the worker owns one)."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.draft_tokens = self.accepted_tokens = self.emitted_tokens = self.max_emitted_tokens = 0
        self.checked_tokens = 0

    def record(self, num_proposed: list[int], num_emitted: list[int]) -> None:
        """One step: per speculating sequence, the tokens proposed and the tokens emitted
        (accepted + 1). A sequence with no proposal is not counted (it decoded plainly)."""
        for proposed, emitted in zip(num_proposed, num_emitted):
            if proposed:
                self.draft_tokens += proposed
                self.accepted_tokens += emitted - 1
                self.emitted_tokens += emitted
                self.max_emitted_tokens += proposed + 1
                # Guesses up to and including the first rejected one (all, if none was).
                self.checked_tokens += min(emitted, proposed)

    def metrics(self) -> SpecDecodeWorkerMetrics:
        return SpecDecodeWorkerMetrics(
            draft_acceptance_rate=_ratio(self.accepted_tokens, self.draft_tokens),
            system_efficiency=_ratio(self.emitted_tokens, self.max_emitted_tokens),
            draft_tokens=self.draft_tokens,
            emitted_tokens=self.emitted_tokens,
            accepted_tokens=self.accepted_tokens,
            num_spec_tokens=self.num_spec_tokens,
            checked_tokens=self.checked_tokens,
        )


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else float("nan")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Leviathan et al. (2023), eq. 1: the expected tokens one speculative step emits when
    each checked guess is accepted with probability `alpha` (independently): (1 - alpha^(k+1))
    / (1 - alpha); k + 1 when alpha = 1. (`SpecDecodeWorkerMetrics.alpha` estimates alpha.)"""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al. (2023), Theorem 3.8: the expected wall-time improvement factor, with
    `cost_ratio` c = (time of one draft step) / (time of one target step), assuming the
    target's k + 1-token scoring pass costs one target step: tokens per step / (k c + 1)."""
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + 1)
