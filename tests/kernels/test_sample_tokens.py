"""`sample_tokens` (Triton, and its PyTorch reference) against definitions written here.

The independent spec is an ascending sort, as transformers' warpers do it: `apply_top_k_top_p`
and `apply_min_p` below give each row's kept set, and a token's logprob must be z[token] - logsumexp(z over that set). The
random draws are checked for their distribution (chi-square over many offsets), for
reproducibility and for independence from the rest of the batch. On the CPU the kernels run
in Triton's interpreter (tests/conftest.py), about 10 ms a row, so shapes here are tiny.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.kernels import reference, sampling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLEMENTATIONS = [pytest.param(sampling.sample_tokens, id="triton"),
                   pytest.param(reference.sample_tokens, id="reference")]


def make_params(num_rows, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1234, offsets=None):
    """The six per-row tensors of `sample_tokens`, from scalars or lists."""
    def column(value, dtype):
        values = value if isinstance(value, (list, tuple)) else [value] * num_rows
        return torch.tensor(values, dtype=dtype, device=DEVICE)
    offsets = list(range(num_rows)) if offsets is None else offsets
    return (column(temperature, torch.float32), column(top_k, torch.int64), column(top_p, torch.float32),
            column(min_p, torch.float32), column(seed, torch.int64), column(offsets, torch.int64))


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    top_ks: `[rows]` int (-1 = off); top_ps: `[rows]` float (1.0 = off). Ties at the k-th
    value are kept, and the most likely token always survives top-p (as in transformers).
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    k = torch.where(top_ks < 0, vocab_size, top_ks).clamp(max=vocab_size).to(logits.device)
    # In ascending order the k-th largest value sits at index vocab_size - k.
    kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, -float("inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is at most 1 - p; never the last (largest) token.
    drop = cumulative <= (1.0 - top_ps.to(logits.device)).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -float("inf"))


def spec_kept(logits, temperature, top_k, top_p, min_p):
    """`[rows, vocab]` kept set by the functions above (their -1 means top-k off)."""
    z = logits.float() / torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    host_k = torch.where((top_k <= 0) | (top_k >= z.shape[1]), -1, top_k)
    masked = apply_min_p(apply_top_k_top_p(z, host_k, top_p), min_p)
    return z, torch.isfinite(masked)


def check_against_spec(logits, params, tokens, logprobs, atol=1e-5, ties=False):
    """Every token in its row's kept set, with logprob z[token] - logsumexp(z over the set).

    ties: the logits tie (bf16) and top-p's last needed value may be shared by several
    tokens, of which the sort above keeps those it puts first: then the kept set
    may hold any of them (the token must be >= the set's smallest z) and the logprob lies
    between those of the sets with none and with all of them.
    """
    z, kept = spec_kept(logits, *params[:4])
    rows = torch.arange(len(tokens), device=tokens.device)
    token_z = z[rows, tokens]
    if not ties:
        assert kept[rows, tokens].all(), f"tokens outside the kept set in rows {(~kept[rows, tokens]).nonzero().flatten().tolist()}"
        expected = token_z - torch.logsumexp(z.masked_fill(~kept, -float("inf")), dim=-1)
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=atol)
        return
    smallest = z.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values
    assert (token_z >= smallest.squeeze(1)).all(), "tokens below the kept set"
    with_all = z.masked_fill(z < smallest, -float("inf"))
    with_none = z.masked_fill(z <= smallest, -float("inf"))
    with_none[rows, tokens] = token_z
    low = token_z - torch.logsumexp(with_all, dim=-1) - atol
    high = token_z - torch.logsumexp(with_none, dim=-1) + atol
    assert ((logprobs >= low) & (logprobs <= high)).all(), "logprobs outside the kept sets' range"


def mixed_batch(num_rows, vocab_size, seed=0):
    """Random logits and a random mix of greedy / temperature / top-k / top-p / min-p rows."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(num_rows, vocab_size, generator=generator)
    pick = lambda *choices: [choices[i] for i in torch.randint(len(choices), (num_rows,), generator=generator).tolist()]
    params = make_params(num_rows, temperature=pick(0.0, 0.5, 1.0, 1.5), top_k=pick(-1, 0, 1, 3, 10, vocab_size),
                         top_p=pick(1.0, 1.0, 0.5, 0.9), min_p=pick(0.0, 0.0, 0.1),
                         seed=torch.randint(2**62, (num_rows,), generator=generator).tolist())
    return logits.to(DEVICE), params


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_the_argmax_with_the_kept_sets_logprob(dtype):
    """Greedy rows (T = 0), truncated or not, across two 4096-blocks and with ties."""
    logits = (3 * torch.randn(4, 5000, generator=torch.Generator().manual_seed(0))).to(DEVICE, dtype)
    logits[1, [7, 4500]] = 20.0  # a tie across blocks: the first index wins, as torch.argmax
    params = make_params(4, temperature=0.0, top_k=[-1, 5, -1, 2], top_p=[1.0, 1.0, 0.5, 0.9], min_p=[0.0, 0.0, 0.0, 0.2])
    tokens, logprobs = sampling.sample_tokens(logits, *params)
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    check_against_spec(logits, params, tokens, logprobs)
    ref_tokens, ref_logprobs = reference.sample_tokens(logits, *params)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,top_k_dtype", [
    pytest.param(sampling.sample_tokens, torch.int64, id="triton"),
    pytest.param(sampling.sample_tokens, torch.int32, id="triton-int32-top_k"),
    pytest.param(reference.sample_tokens, torch.int64, id="reference"),
])
def test_every_token_is_kept_with_its_kept_set_logprob(impl, top_k_dtype):
    logits, params = mixed_batch(24, 48)
    params = (params[0], params[1].to(top_k_dtype), *params[2:])
    tokens, logprobs = impl(logits, *params)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.device == logits.device == logprobs.device
    check_against_spec(logits, params, tokens, logprobs)


def test_temperature_only_rows_match_the_candidate_path():
    """The two kernels share one noise function of (seed, offset, token id): a row whose
    kept set is everything draws the same token in the one-pass kernel and among candidates."""
    logits, _ = mixed_batch(8, 32, seed=1)
    plain = make_params(8, temperature=0.9, seed=list(range(8)))
    everything_kept = make_params(8, temperature=0.9, seed=list(range(8)), min_p=1e-30)  # truncates, drops nothing
    tokens, logprobs = sampling.sample_tokens(logits, *plain, needs_truncation=False)
    cand_tokens, cand_logprobs = sampling.sample_tokens(logits, *everything_kept, num_candidates=32)
    assert torch.equal(tokens, cand_tokens)
    torch.testing.assert_close(logprobs, cand_logprobs)


def test_overflowing_candidates_fall_back_to_the_exact_kept_set():
    """Kept sets past 4 candidates: a nucleus (flat rows, top-p 0.95), a tie at the k-th
    value (ten tokens tied, top-k 2 keeps them all), top-k 30 with top-p and min-p, greedy
    with min-p, top-k 12 alone. Redone by the bisection kernel, the tokens equal a run whose
    candidates are the whole vocabulary (same noise per token id, same kept set)."""
    logits = torch.zeros(9, 40, device=DEVICE)
    logits[:, :10] = 1.0
    logits[:3] = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 0.1
    logits[6:] = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    params = make_params(9, temperature=[1.0] * 7 + [0.0, 1.0], top_k=[-1, -1, -1, 2, 2, 2, 30, -1, 12],
                         top_p=[0.95] * 3 + [1.0] * 3 + [0.9, 1.0, 1.0], min_p=[0.0] * 6 + [0.05, 0.1, 0.0],
                         seed=[5, 6, 7, 8, 9, 10, 11, 12, 13])
    tokens, logprobs = sampling.sample_tokens(logits, *params, num_candidates=4)
    check_against_spec(logits, params, tokens, logprobs)
    full_tokens, full_logprobs = sampling.sample_tokens(logits, *params, num_candidates=40)
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(logprobs, full_logprobs)


def test_no_host_sync_when_the_hints_are_given(monkeypatch):
    """The multi-step loop must not block: with both hints, no device value reaches Python."""
    logits, params = mixed_batch(6, 32, seed=7)
    expected = sampling.sample_tokens(logits, *params, needs_truncation=True, num_candidates=4)

    def sync(*args, **kwargs):
        raise AssertionError("a device value was read on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    tokens, logprobs = sampling.sample_tokens(logits, *params, needs_truncation=True, num_candidates=4)
    monkeypatch.undo()
    assert torch.equal(tokens, expected[0]) and torch.equal(logprobs, expected[1])


# --------------------------------------------------------------------------- distribution
def chi_square_critical(df: int, z_alpha: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z 3.719: alpha = 1e-4."""
    h = 2 / (9 * df)
    return df * (1 - h + z_alpha * math.sqrt(h)) ** 3


def pool_small_bins(expected, observed, min_expected=5.0):
    """Tokens expected fewer than 5 times pooled into one bin (the chi-square approximation
    needs it); a pool still under 5 joins the least likely big bin."""
    small = expected < min_expected
    if not small.any():
        return expected, observed
    expected_big, observed_big = expected[~small], observed[~small]
    pool_expected, pool_observed = expected[small].sum(), observed[small].sum()
    if pool_expected < min_expected:
        least = expected_big.argmin()
        expected_big[least] += pool_expected
        observed_big[least] += pool_observed
        return expected_big, observed_big
    return torch.cat([expected_big, pool_expected.view(1)]), torch.cat([observed_big, pool_observed.view(1)])


DRAWS = 300  # rows of one call, each its own offset: 300 draws from one distribution
CHI_SQUARE_LOGITS = [2.0, 1.6, 1.2, 1.0, 0.5, 0.0, -0.5, -2.0]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("setting", [
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.3, top_p=0.7),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05),
], ids=["temperature", "top_k", "top_p", "min_p", "combined"])
def test_draws_follow_the_kept_distribution(impl, setting):
    vocab_size = len(CHI_SQUARE_LOGITS)
    logits = torch.tensor([CHI_SQUARE_LOGITS], device=DEVICE).expand(DRAWS, vocab_size).contiguous()
    params = make_params(DRAWS, seed=99, **setting)
    tokens, _ = impl(logits, *params)
    z, kept = spec_kept(logits[:1], *(p[:1] for p in params[:4]))
    probs = z.masked_fill(~kept, -float("inf")).softmax(dim=-1)[0].double().cpu()
    counts = torch.bincount(tokens.cpu(), minlength=vocab_size).double()
    assert counts[~kept[0].cpu()].sum() == 0, "a token outside the kept set was drawn"
    expected, observed = pool_small_bins(probs[kept[0].cpu()] * DRAWS, counts[kept[0].cpu()])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = len(expected) - 1
    if df == 0:
        return  # one kept token: already checked that nothing else was drawn
    assert statistic < chi_square_critical(df), (
        f"chi-square {statistic:.1f} >= {chi_square_critical(df):.1f} (df {df}): observed "
        f"{observed.tolist()}, expected {[round(e, 1) for e in expected.tolist()]}")


# --------------------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_rows_token_depends_only_on_its_logits_seed_and_offset(impl):
    logits, params = mixed_batch(12, 40, seed=3)
    tokens, logprobs = impl(logits, *params)
    again, _ = impl(logits, *params)
    assert torch.equal(tokens, again)
    # Reordered, with rows of another batch mixed in: each row's token is unchanged.
    other_logits, other_params = mixed_batch(5, 40, seed=4)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    batch_logits = torch.cat([logits[order], other_logits])
    batch_params = [torch.cat([p[order], q]) for p, q in zip(params, other_params)]
    shuffled_tokens, shuffled_logprobs = impl(batch_logits, *batch_params)
    assert torch.equal(shuffled_tokens[:12], tokens[order])
    torch.testing.assert_close(shuffled_logprobs[:12], logprobs[order])


@pytest.mark.parametrize("module", [pytest.param(sampling, id="triton"), pytest.param(reference, id="reference")])
def test_race_noise_is_the_noise_a_random_row_adds(module):
    """`race_noise` (what the rejection sampler draws with) is `sample_tokens`' own noise: a
    temperature-only row's token is arg-max(z + noise)."""
    logits, _ = mixed_batch(12, 40, seed=9)
    params = make_params(12, temperature=0.8, seed=list(range(100, 112)), offsets=[3 * i for i in range(12)])
    tokens, _ = module.sample_tokens(logits, *params)
    noise = module.race_noise(params[4], params[5], 40)
    assert noise.shape == (12, 40) and noise.dtype == torch.float32 and noise.isfinite().all()
    assert torch.equal((logits.float() / 0.8 + noise).argmax(dim=-1), tokens)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_all_64_bits_of_seed_and_offset_matter(impl):
    """Seeds or offsets 2^32 apart (or past 2^32) give unrelated draws, not the same ones."""
    num_rows, vocab_size = 60, 16
    logits = torch.zeros(num_rows, vocab_size, device=DEVICE)  # uniform: every token equally likely
    base, _ = impl(logits, *make_params(num_rows, seed=7, offsets=list(range(num_rows))))
    for params in (make_params(num_rows, seed=7 + 2**32, offsets=list(range(num_rows))),
                   make_params(num_rows, seed=7, offsets=[o + 2**32 for o in range(num_rows)])):
        shifted, _ = impl(logits, *params)
        # Unrelated uniform draws agree 1 time in 16; identical streams would agree always.
        assert (shifted == base).float().mean() < 0.3
    assert len(set(base.tolist())) > 5  # different offsets: different draws


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_input_raises_with_the_reason(impl):
    params = make_params(3)
    with pytest.raises(ValueError, match="2-D"):
        impl(torch.zeros(3, device=DEVICE), *params)
    with pytest.raises(ValueError, match="unit stride"):
        impl(torch.zeros(8, 3, device=DEVICE).t(), *params)
    with pytest.raises(ValueError, match="top_p must have shape"):
        impl(torch.zeros(3, 8, device=DEVICE), *params[:2], params[2][:2], *params[3:])
    with pytest.raises(ValueError, match="top_k must be an integer"):
        impl(torch.zeros(3, 8, device=DEVICE), params[0], params[1].float(), *params[2:])
    with pytest.raises(ValueError, match="float"):
        impl(torch.zeros(3, 8, dtype=torch.int64, device=DEVICE), *params)


# --------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
def test_bf16_qwen_vocabulary_against_the_spec_and_the_reference():
    """256 rows x 151,936 bf16 logits, every kind of row: kept sets and logprobs as the host
    sampler defines them; greedy tokens and every logprob equal to the reference's."""
    logits, params = mixed_batch(256, 151936, seed=5)
    logits = logits.to(torch.bfloat16)
    tokens, logprobs = sampling.sample_tokens(logits, *params)
    check_against_spec(logits, params, tokens, logprobs, atol=1e-4, ties=True)
    ref_tokens, ref_logprobs = reference.sample_tokens(logits, *params)
    check_against_spec(logits, params, ref_tokens, ref_logprobs, atol=1e-4, ties=True)
    greedy = params[0] == 0
    assert torch.equal(tokens[greedy], ref_tokens[greedy])
    # Without top-p ties (no top-p rows), every logprob given the token is the reference's.
    no_top_p = params[2] >= 1.0
    kept = reference.kept_mask(logits.float() / torch.where(greedy, 1.0, params[0]).unsqueeze(1), *params[1:4])
    z = logits.float() / torch.where(greedy, 1.0, params[0]).unsqueeze(1)
    rows = torch.arange(256, device=DEVICE)
    expected = z[rows, tokens] - torch.logsumexp(z.masked_fill(~kept, -float("inf")), dim=-1)
    torch.testing.assert_close(logprobs[no_top_p], expected[no_top_p], rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_bf16_qwen_vocabulary_never_syncs_with_the_hints():
    logits, params = mixed_batch(256, 151936, seed=8)
    logits = logits.to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs = sampling.sample_tokens(logits, *params, needs_truncation=True, num_candidates=1024)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_against_spec(logits, params, tokens, logprobs, atol=1e-4, ties=True)


@pytest.mark.gpu
def test_bf16_nucleus_past_the_candidate_cap_falls_back():
    """Flat rows with top-p 0.95: the nucleus holds ~140k tokens, far past 1,024 candidates."""
    generator = torch.Generator().manual_seed(6)
    logits = (0.05 * torch.randn(16, 151936, generator=generator)).to(DEVICE, torch.bfloat16)
    params = make_params(16, top_p=0.95, seed=list(range(16)))
    tokens, logprobs = sampling.sample_tokens(logits, *params)
    check_against_spec(logits, params, tokens, logprobs, atol=1e-4, ties=True)
    untied = logits.float() + 1e-3 * torch.randn(logits.shape, generator=generator).to(DEVICE)
    tokens, logprobs = sampling.sample_tokens(untied, *params)  # exactly the sort-based kept set
    check_against_spec(untied, params, tokens, logprobs, atol=1e-4)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_rows_cut_into_slices_give_the_one_program_result(monkeypatch, num_splits):
    """At small batches each row is read by several programs (`_num_row_splits`), whose
    partials are merged: the same tokens (ties to the first index) and logprobs, for greedy,
    random and threshold (top-k) rows, including slices with nothing kept."""
    vocab = 96
    logits = torch.randn(4, vocab, device=DEVICE)
    logits[0, 5] = logits[0, 70] = logits[0].max() + 1.0  # a tie across two slices: token 5 wins
    params = make_params(4, temperature=[0.0, 0.7, 1.3, 0.9], top_k=[-1, -1, 3, -1], seed=[1, 2, 3, 4])
    one_tokens, one_logprobs = sampling.sample_tokens(logits, *params)
    monkeypatch.setattr(sampling, "_num_row_splits", lambda *args: num_splits)
    monkeypatch.setattr(sampling, "_block", lambda vocab_size: 16)  # several blocks per slice
    tokens, logprobs = sampling.sample_tokens(logits, *params)
    assert tokens.tolist() == one_tokens.tolist()
    assert tokens[0] == 5
    torch.testing.assert_close(logprobs, one_logprobs, rtol=1e-5, atol=1e-5)
    check_against_spec(logits, params, tokens, logprobs)
