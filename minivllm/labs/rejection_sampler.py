"""Checks of lab 08: speculative decoding's rejection sampler (`notebooks/labs/lab08_rejection_sampler.ipynb`).

The learner's class has the call of `minivllm.model_executor.layers.rejection_sampler.RejectionSampler`
(vLLM 0.6's `vllm/model_executor/layers/rejection_sampler.py`) and two pieces of it:

    accept_probs(target_probs, draft_probs, draft_token_ids)  -> [batch, k]          min(1, p_i(d_i) / q_i(d_i))
    recovered_probs(target_probs, draft_probs)                -> [batch, k, vocab]   norm(max(0, p_i - q_i)),
                                                                 p_i where that is all zero
    __call__(target_probs [batch, k + 1, vocab], draft_token_ids [batch, k], num_proposed [batch],
             draft_probs [batch, k, vocab] or None, generator) -> [batch, k + 1]: accepted drafts,
             one recovered or bonus token, then NO_TOKEN

Expected values: greedy cases from the package's `RejectionSampler` (deterministic there), the
pieces from their formulas, the output distribution from the exact sum over accept / resample
and from a seeded Monte-Carlo run, both against the target's p. Then the learner's worker class
(a `SpecDecodeWorker` whose `rejection_sampler` is theirs) runs inside a real `LLM`.
"""

from __future__ import annotations

import torch

from minivllm.labs import LabCheckFailed, expect, expect_tensor, expect_yours, passed
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.model_executor.layers.rejection_sampler import NO_TOKEN, RejectionSampler
from minivllm.spec_decode.spec_decode_worker import SpecDecodeWorker

# Small distributions with the cases that matter: p > q somewhere (the min bites), q = 0 where
# p > 0 (only a resample can emit that token), p = 0 where q > 0 (never emitted), p == q.
DISTRIBUTION_CASES = (
    ([0.40, 0.25, 0.15, 0.10, 0.10, 0.00], [0.05, 0.10, 0.15, 0.20, 0.20, 0.30]),
    ([0.60, 0.20, 0.20, 0.00], [0.20, 0.80, 0.00, 0.00]),
    ([0.10, 0.20, 0.30, 0.40], [0.10, 0.20, 0.30, 0.40]),
    ([0.00, 0.00, 1.00, 0.00], [0.25, 0.25, 0.25, 0.25]),
)
MONTE_CARLO_SAMPLES = 60_000
# A count's tolerance: this many standard deviations of a binomial frequency, plus a floor.
MONTE_CARLO_SIGMAS = 5.0
MONTE_CARLO_FLOOR = 0.002


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _pairs(case_p, case_q, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One case as target `[1, k + 1, vocab]` and draft `[1, k, vocab]` probabilities."""
    p, q = torch.tensor(case_p), torch.tensor(case_q)
    return p.expand(1, k + 1, -1).clone(), q.expand(1, k, -1).clone()


# ------------------------------------------------------------------ greedy
def _greedy_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy targets (one-hot at the arg-max) and drafts that agree for 0..k positions."""
    vocab = 7
    argmax = torch.tensor([[3, 1, 4, 2], [3, 1, 4, 2], [3, 1, 4, 2], [3, 1, 4, 2], [5, 5, 0, 6], [6, 0, 2, 1]])
    drafts = torch.tensor([[3, 1, 4], [3, 1, 0], [3, 6, 4], [0, 1, 4], [5, 5, 0], [6, 0, 2]])
    num_proposed = torch.tensor([3, 3, 3, 3, 2, 1])
    target = torch.nn.functional.one_hot(argmax, vocab).float()
    return target, drafts, num_proposed


def check_greedy(sampler_cls) -> None:
    """A greedy target (p one-hot at its arg-max): drafts are accepted while they equal the
    arg-max; then the arg-max itself is emitted (the bonus token when every proposal matched)."""
    target, drafts, num_proposed = _greedy_batch()
    vocab = target.shape[2]
    expected = RejectionSampler()(target, drafts, num_proposed)
    one_hot_q = torch.nn.functional.one_hot(drafts, vocab).float()
    cases = (("draft_probs=None (an n-gram proposer)", None), ("one-hot draft_probs (a greedy draft model)", one_hot_q))
    for label, q in cases:
        got = sampler_cls()(target.clone(), drafts.clone(), num_proposed.clone(), q,
                            generator=torch.Generator().manual_seed(0))
        expect_tensor(got, expected.shape, what=f"greedy, {label}: the sampler ([batch, k + 1])")
        for row in range(len(drafts)):
            expect(got[row].tolist() == expected[row].tolist(),
                   f"greedy, {label}, row {row}: drafts {drafts[row].tolist()} ({num_proposed[row]} proposed), "
                   f"target arg-max {target[row].argmax(-1).tolist()}: expected {expected[row].tolist()}, "
                   f"got {got[row].tolist()} ({NO_TOKEN} = no token)")
    passed("greedy: drafts accepted while they equal the target's arg-max, then the arg-max")


# ------------------------------------------------------------------ the two pieces
def check_accept_probs(sampler_cls) -> None:
    """accept_probs = min(1, p_i(d_i) / q_i(d_i)) for every draft position."""
    sampler = sampler_cls()
    for case_p, case_q in DISTRIBUTION_CASES:
        vocab = len(case_p)
        q_row = torch.tensor(case_q)
        drafts = torch.nonzero(q_row > 0).flatten()  # every token the draft can propose
        target, draft = _pairs(case_p, case_q)
        got = sampler.accept_probs(target.expand(len(drafts), -1, -1), draft.expand(len(drafts), -1, -1),
                                   drafts.unsqueeze(1))
        expect_tensor(got, (len(drafts), 1), what=f"accept_probs with {len(drafts)} sequences, k = 1, vocab {vocab}")
        want = torch.minimum(torch.ones(()), torch.tensor(case_p)[drafts] / q_row[drafts])
        for token, g, w in zip(drafts.tolist(), got[:, 0].tolist(), want.tolist()):
            expect(abs(g - w) < 1e-5,
                   f"accept_probs with p = {_fmt(case_p)}, q = {_fmt(case_q)}, draft token {token}: expected "
                   f"min(1, {case_p[token]:.3f} / {case_q[token]:.3f}) = {w:.4f}, got {g:.4f}"
                   + (" (a probability is at most 1)" if g > 1 else ""))
    passed("accept_probs = min(1, p(d) / q(d))")


def check_recovered_probs(sampler_cls) -> None:
    """recovered_probs = (p_i - q_i)+ normalized; p_i where p_i <= q_i everywhere (p_i == q_i)."""
    sampler = sampler_cls()
    for case_p, case_q in DISTRIBUTION_CASES:
        target, draft = _pairs(case_p, case_q, k=2)
        got = sampler.recovered_probs(target, draft)
        expect_tensor(got, draft.shape, what=f"recovered_probs with k = 2, vocab {len(case_p)}")
        residual = (torch.tensor(case_p) - torch.tensor(case_q)).clamp(min=0)
        want = residual / residual.sum() if residual.sum() > 0 else torch.tensor(case_p)
        expect(bool(torch.isfinite(got).all()),
               f"recovered_probs with p = {_fmt(case_p)}, q = {_fmt(case_q)}: got {_fmt(got[0, 0].tolist())}, which "
               f"is not finite; where p == q the residual is all zero (a rejection cannot happen): return p there")
        expect(torch.allclose(got[0, 0], want, atol=1e-5),
               f"recovered_probs with p = {_fmt(case_p)}, q = {_fmt(case_q)}: expected norm(max(0, p - q)) = "
               f"{_fmt(want.tolist())}, got {_fmt(got[0, 0].tolist())}")
    passed("recovered_probs = norm(max(0, p - q))")


def check_exact_distribution(sampler_cls) -> None:
    """With d ~ q, accepted with accept_probs and else replaced by a draw from recovered_probs,
    token x is emitted with probability q(x) a(x) + (1 - sum_y q(y) a(y)) r(x): it must be p(x)."""
    sampler = sampler_cls()
    for case_p, case_q in DISTRIBUTION_CASES:
        p, q = torch.tensor(case_p, dtype=torch.float64), torch.tensor(case_q, dtype=torch.float64)
        vocab = len(case_p)
        target, draft = _pairs(case_p, case_q)
        tokens = torch.arange(vocab)
        accept = sampler.accept_probs(target.expand(vocab, -1, -1), draft.expand(vocab, -1, -1), tokens.unsqueeze(1))
        accept = torch.where(q > 0, accept[:, 0].double(), 0.0)  # a token q never proposes: no term
        recovered = sampler.recovered_probs(target, draft)[0, 0].double()
        accepted = q * accept
        emitted = accepted + (1 - accepted.sum()) * recovered
        worst = int((emitted - p).abs().argmax())
        expect(abs(float(emitted[worst] - p[worst])) < 1e-5,
               f"p = {_fmt(case_p)}, q = {_fmt(case_q)}: accepting with your accept_probs and resampling from "
               f"your recovered_probs emits {_fmt(emitted.tolist())}; token {worst} should have probability "
               f"p = {p[worst]:.3f}, it has {emitted[worst]:.3f}")
    passed("exactly: accept or resample emits every token with the target's probability p")


# ------------------------------------------------------------------ the whole call
def _monte_carlo_case() -> tuple[torch.Tensor, torch.Tensor]:
    """k = 2 positions with different p and q, and the target's row for the bonus token."""
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                      [0.10, 0.50, 0.05, 0.05, 0.20, 0.10],
                      [0.05, 0.05, 0.30, 0.30, 0.10, 0.20]])
    q = torch.tensor([[0.30, 0.10, 0.15, 0.20, 0.05, 0.20],
                      [0.20, 0.30, 0.20, 0.10, 0.10, 0.10]])
    return p, q


def _expect_frequencies(label: str, tokens: torch.Tensor, p: torch.Tensor) -> None:
    n = len(tokens)
    expect(n > 1000, f"{label}: only {n} samples (too few drafts were accepted to test the next position)")
    frequency = torch.bincount(tokens, minlength=len(p)).double() / n
    tolerance = MONTE_CARLO_SIGMAS * (p.double() * (1 - p.double()) / n).sqrt() + MONTE_CARLO_FLOOR
    worst = int(((frequency - p).abs() - tolerance).argmax())
    expect(bool(((frequency - p).abs() <= tolerance).all()),
           f"{label}: over {n} samples token {worst} came {frequency[worst]:.4f} of the time, the target's p says "
           f"{p[worst]:.4f} (tolerance {tolerance[worst]:.4f}); frequencies {_fmt(frequency.tolist())}, "
           f"p {_fmt(p.tolist())}")


def check_sampled_distribution(sampler_cls) -> None:
    """The call itself, seeded, on drafts drawn from q: the output's layout, then each position's
    token frequencies against p (position 1 given draft 0 accepted, the bonus given both)."""
    p, q = _monte_carlo_case()
    n, k, vocab = MONTE_CARLO_SAMPLES, q.shape[0], p.shape[1]
    torch.manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(1)).T.contiguous()
    out = sampler_cls()(p.expand(n, -1, -1).contiguous(), drafts, torch.full((n,), k), q.expand(n, -1, -1).contiguous(),
                        generator=torch.Generator().manual_seed(2))
    expect(tuple(out.shape) == (n, k + 1), f"expected a [{n}, {k + 1}] output, got {list(out.shape)}")
    emitted = out != NO_TOKEN
    num_emitted = emitted.sum(dim=1)
    prefix_ok = emitted == (torch.arange(k + 1) < num_emitted.unsqueeze(1))
    bad = (~prefix_ok.all(dim=1)) | (num_emitted == 0)
    if bad.any():
        row = int(bad.nonzero()[0])
        raise LabCheckFailed(f"row {row} is {out[row].tolist()}: each row emits its accepted drafts, then exactly "
                             f"one more token, then {NO_TOKEN} ({NO_TOKEN} = no token)")
    accepted = num_emitted - 1
    for i in range(k):
        took = accepted > i
        expect(bool((out[took, i] == drafts[took, i]).all()),
               f"position {i}: a row that went on past it must have emitted its draft token there")
    _expect_frequencies("position 0 (accepted draft or resampled)", out[:, 0], p[0])
    _expect_frequencies("position 1, given draft 0 accepted", out[accepted >= 1, 1], p[1])
    _expect_frequencies("position 2 (the bonus token), given both drafts accepted", out[accepted >= 2, 2], p[2])
    passed(f"sampled ({n} seeded rows): each position's tokens follow the target's p")


def check_rejection_sampler(sampler_cls) -> None:
    """Every unit case, in the order the lab builds them."""
    check_accept_probs(sampler_cls)
    check_recovered_probs(sampler_cls)
    check_exact_distribution(sampler_cls)
    check_greedy(sampler_cls)
    check_sampled_distribution(sampler_cls)


# ------------------------------------------------------------------ in the engine
def check_in_engine(worker_cls, speculative_model: str = "tiny-shakespeare-draft", num_speculative_tokens: int = 3,
                    prompts=None, max_tokens: int = 16, **engine_kwargs) -> list[list[int]]:
    """`LLM(speculative_model=..., worker_cls=worker_cls)` generates greedily, token-identical to
    transformers, with the learner's rejection sampler accepting some of the drafts."""
    from minivllm.entrypoints.llm import LLM
    from minivllm.viz.device import engine_kwargs as device_kwargs

    expect(isinstance(worker_cls, type) and issubclass(worker_cls, SpecDecodeWorker),
           f"worker_cls must be a subclass of SpecDecodeWorker, got {worker_cls!r}")
    llm = LLM(**device_kwargs(speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens,
                              worker_cls=worker_cls, **engine_kwargs))
    worker = llm.llm_engine.model_executor.driver_worker
    expect_yours(worker, worker_cls, "the engine's worker")
    expect(type(worker.rejection_sampler) is not RejectionSampler,
           f"{worker_cls.__name__}.rejection_sampler is still the package's RejectionSampler: "
           "set it to yours in __init__")
    kwargs = {} if prompts is None else {"prompts": prompts}
    tokens = assert_greedy_matches_transformers(max_tokens=max_tokens, llm=llm, **kwargs)
    metrics = worker.counter.metrics()
    expect(metrics.accepted_tokens > 0,
           f"{speculative_model}: {metrics.draft_tokens} draft tokens proposed, none accepted by "
           f"{type(worker.rejection_sampler).__name__}: the engine decoded without speculating")
    passed(f"{speculative_model}, k = {num_speculative_tokens}: {metrics.accepted_tokens} of {metrics.draft_tokens} "
           f"drafts accepted by {type(worker.rejection_sampler).__name__}")
    return tokens


__all__ = ["LabCheckFailed", "check_accept_probs", "check_exact_distribution", "check_greedy", "check_in_engine",
           "check_recovered_probs", "check_rejection_sampler", "check_sampled_distribution"]
