"""The rejection sampler leaves the target's distribution exactly unchanged.

Statistical tests on a small vocabulary with many draws and fixed seeds (they cannot flake:
the same seed gives the same draws). A chi-square statistic compares the emitted tokens'
counts with the target's probabilities; the threshold is the chi-square quantile at
1 - 1e-4 (Wilson-Hilferty approximation), and each test also shows that a sampler that
ignored the rule (emitting the draft) would fail it by far.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from minivllm.model_executor.layers.rejection_sampler import NO_TOKEN, RejectionSampler, num_emitted

VOCAB = 6
DRAWS = 40_000
_Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4


def chi2_threshold(df: int, z: float = _Z_1E4) -> float:
    """Wilson-Hilferty: the chi-square(df) quantile whose normal quantile is z."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of `counts` against `probs` (cells with p = 0 must have no count)."""
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    expected = probs * counts.sum()
    keep = probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _dist(generator: torch.Generator, rows: int = 1, zero: int | None = None) -> torch.Tensor:
    probs = torch.rand(rows, VOCAB, generator=generator) ** 2  # uneven, as real ones are
    if zero is not None:
        probs[:, zero] = 0.0
    return probs / probs.sum(dim=1, keepdim=True)


def _draw(probs: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=generator)


@pytest.mark.parametrize("case", ["random_draft", "deterministic_draft", "draft_equals_target"])
def test_first_token_is_distributed_as_the_target(case):
    g = torch.Generator().manual_seed(0)
    p = _dist(g, zero=5)[0]  # a token the target never emits
    q = p.clone() if case == "draft_equals_target" else _dist(g)[0]
    drafts = _draw(q, DRAWS, g)  # the draft samples from q (n-gram: any fixed guess does)
    if case == "deterministic_draft":
        drafts = torch.full((DRAWS,), 5, dtype=torch.long)  # always guesses the impossible token
    target = p.expand(DRAWS, 2, VOCAB).contiguous()
    draft_probs = None if case == "deterministic_draft" else q.expand(DRAWS, 1, VOCAB).contiguous()
    out = RejectionSampler()(target, drafts.unsqueeze(1), torch.ones(DRAWS, dtype=torch.long), draft_probs,
                             generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(out[:, 0], minlength=VOCAB).float()
    assert chi2(counts, p) < chi2_threshold(VOCAB - 2)
    if case == "draft_equals_target":
        assert (num_emitted(out) == 2).all(), "q = p: every proposal is accepted"
    if case == "deterministic_draft":
        assert (num_emitted(out) == 1).all(), "p(draft) = 0: every proposal is rejected"
    # The same draws with the rule ignored (emit the draft) fail the test by far.
    if case == "random_draft":
        assert chi2(torch.bincount(drafts, minlength=VOCAB).float() * (p > 0), p) > 10 * chi2_threshold(VOCAB - 2)


def test_each_later_token_follows_the_target_given_the_tokens_before_it():
    """A Markov "language model": the target P[prev] and the draft Q[prev] differ. From
    context token c, the draft proposes d1 ~ Q[c], d2 ~ Q[d1]; the target scores P[c], P[d1],
    P[d2]. Whatever is emitted, t1 ~ P[c] and, when a second token comes, t2 | t1 ~ P[t1]."""
    g = torch.Generator().manual_seed(2)
    P, Q = _dist(g, VOCAB), _dist(g, VOCAB)
    c = 3
    d1 = _draw(Q[c], DRAWS, g)
    d2 = torch.multinomial(Q[d1], 1, generator=g).squeeze(1)
    target = torch.stack([P[c].expand(DRAWS, VOCAB), P[d1], P[d2]], dim=1)
    draft_probs = torch.stack([Q[c].expand(DRAWS, VOCAB), Q[d1]], dim=1)
    out = RejectionSampler()(target, torch.stack([d1, d2], dim=1), torch.full((DRAWS,), 2), draft_probs,
                             generator=torch.Generator().manual_seed(3))
    assert chi2(torch.bincount(out[:, 0], minlength=VOCAB).float(), P[c]) < chi2_threshold(VOCAB - 1)
    two = out[:, 1] != NO_TOKEN
    pairs = torch.zeros(VOCAB, VOCAB)
    pairs.index_put_((out[two, 0], out[two, 1]), torch.ones(int(two.sum())), accumulate=True)
    statistic = sum(chi2(pairs[a], P[a]) for a in range(VOCAB) if pairs[a].sum() > 0)
    df = sum(VOCAB - 1 for a in range(VOCAB) if pairs[a].sum() > 0)
    assert statistic < chi2_threshold(df)
    # Acceptance rate as theory says: P(accept d1) = sum_x min(P[c](x), Q[c](x)).
    expected = float(torch.minimum(P[c], Q[c]).sum())
    assert abs(float(two.float().mean()) - expected) < 4 * math.sqrt(expected * (1 - expected) / DRAWS)


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    target = torch.zeros(3, 4, VOCAB)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    target.scatter_(2, argmax.unsqueeze(2), 1.0)  # greedy: p is one-hot at the arg-max
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [1, 0, 0]])
    out = RejectionSampler()(target, drafts, torch.tensor([3, 3, 3]))
    assert out.tolist() == [[1, 2, 3, 4], [1, 2, NO_TOKEN, NO_TOKEN], [0, NO_TOKEN, NO_TOKEN, NO_TOKEN]]


def test_num_proposed_cuts_each_row_and_the_bonus_comes_from_the_next_position():
    target = torch.zeros(3, 3, VOCAB)
    target.scatter_(2, torch.tensor([[1, 2, 3]] * 3).unsqueeze(2), 1.0)
    drafts = torch.tensor([[1, 2], [1, 2], [1, 2]])
    out = RejectionSampler()(target, drafts, torch.tensor([2, 1, 0]))
    assert out.tolist() == [[1, 2, 3], [1, 2, NO_TOKEN], [1, NO_TOKEN, NO_TOKEN]]
    assert num_emitted(out).tolist() == [3, 2, 1]


def test_no_proposals_at_all_draw_from_the_target():
    g = torch.Generator().manual_seed(4)
    p = _dist(g)[0]
    out = RejectionSampler()(p.expand(DRAWS, 1, VOCAB).contiguous(), torch.zeros(DRAWS, 0, dtype=torch.long),
                             torch.zeros(DRAWS, dtype=torch.long), generator=torch.Generator().manual_seed(5))
    assert out.shape == (DRAWS, 1)
    assert chi2(torch.bincount(out[:, 0], minlength=VOCAB).float(), p) < chi2_threshold(VOCAB - 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 4), st.integers(2, 7), st.booleans(), st.integers(0, 2**31 - 1))
def test_output_is_an_accepted_prefix_then_one_token_then_nothing(batch, k, vocab, deterministic, seed):
    """For any distributions: row b emits its first m guesses (m <= num_proposed[b]), then one
    token the target gives positive probability to, then NO_TOKEN."""
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(batch, k + 1, vocab, generator=g) * (torch.rand(batch, k + 1, vocab, generator=g) > 0.3)
    target[..., 0] += 1e-3  # every row keeps some mass
    target = target / target.sum(-1, keepdim=True)
    draft = torch.rand(batch, k, vocab, generator=g) + 1e-3
    draft = draft / draft.sum(-1, keepdim=True)
    guesses = torch.randint(0, vocab, (batch, k), generator=g)
    num_proposed = torch.randint(0, k + 1, (batch,), generator=g)
    out = RejectionSampler()(target, guesses, num_proposed, None if deterministic else draft, generator=g)
    emitted = num_emitted(out)
    for b in range(batch):
        m = int(emitted[b]) - 1
        assert 0 <= m <= int(num_proposed[b])
        assert out[b, :m].tolist() == guesses[b, :m].tolist()
        assert target[b, m, out[b, m]] > 0
        assert (out[b, m + 1:] == NO_TOKEN).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 4), st.integers(2, 5), st.booleans(), st.integers(0, 2**31 - 1))
def test_greedy_gives_what_the_full_rule_gives_for_one_hot_targets(batch, k, vocab, deterministic, seed):
    """`greedy` from the arg-max alone equals `__call__` on p = one-hot(arg-max), with any q."""
    g = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, vocab, (batch, k + 1), generator=g)
    target = torch.zeros(batch, k + 1, vocab).scatter_(2, argmax.unsqueeze(2), 1.0)
    draft = torch.rand(batch, k, vocab, generator=g) + 1e-3
    draft = draft / draft.sum(-1, keepdim=True)
    # Guesses that often match: each is the arg-max or a random token.
    guesses = torch.where(torch.rand(batch, k, generator=g) < 0.7, argmax[:, :k],
                          torch.randint(0, vocab, (batch, k), generator=g))
    num_proposed = torch.randint(0, k + 1, (batch,), generator=g)
    full = RejectionSampler()(target, guesses, num_proposed, None if deterministic else draft, generator=g)
    for b in range(batch):
        n = int(num_proposed[b])
        emitted = RejectionSampler.greedy(argmax[b, : n + 1].tolist(), guesses[b, :n].tolist())
        assert emitted + [NO_TOKEN] * (k + 1 - len(emitted)) == full[b].tolist()
