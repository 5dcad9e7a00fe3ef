"""Speculative decoding's counts and the papers' formulas."""

import math

import pytest

from minivllm.spec_decode.metrics import AcceptanceCounter, expected_speedup, expected_tokens_per_step


def test_counts_of_a_worked_step():
    """k = 4. Sequence a: 4 proposed, 2 accepted (3 emitted; guesses 1-3 checked, 4 never).
    b: 4 proposed, all accepted (+ the bonus: 5 emitted). c: 2 proposed (lookahead capped),
    0 accepted. d: no proposal (decoded plainly: not counted)."""
    counter = AcceptanceCounter(num_spec_tokens=4)
    counter.record(num_proposed=[4, 4, 2, 0], num_emitted=[3, 5, 1, 1])
    m = counter.metrics()
    assert (m.draft_tokens, m.accepted_tokens, m.emitted_tokens, m.checked_tokens) == (10, 6, 9, 3 + 4 + 1)
    assert m.draft_acceptance_rate == 6 / 10           # vLLM's: every proposed guess
    assert m.alpha == 6 / 8                            # the papers': every checked guess
    assert m.system_efficiency == 9 / (5 + 5 + 3)      # emitted / (proposed + 1) per sequence
    assert m.num_spec_tokens == 4


def test_rates_are_nan_before_any_proposal():
    m = AcceptanceCounter(3).metrics()
    assert math.isnan(m.draft_acceptance_rate) and math.isnan(m.system_efficiency) and math.isnan(m.alpha)


@pytest.mark.parametrize("alpha, k, expected", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.5, 2, 1.75)])
def test_expected_tokens_per_step(alpha, k, expected):
    """1 + alpha + alpha^2 + ... + alpha^k (Leviathan et al. 2023, eq. 1)."""
    assert expected_tokens_per_step(alpha, k) == pytest.approx(expected)


def test_expected_speedup_pays_for_the_draft():
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_step(0.8, 4))
    assert expected_speedup(0.8, 4, 0.25) == pytest.approx(expected_tokens_per_step(0.8, 4) / 2)
    assert expected_speedup(0.2, 8, 0.2) < 1 < expected_speedup(0.2, 1, 0.05)
