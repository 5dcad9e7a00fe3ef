"""Lab 07's checks: temperature, top-k, top-p, min-p and the seeded draw
(`notebooks/labs/lab07_sampler.ipynb`; vLLM 0.6: `vllm/model_executor/layers/sampler.py`).

The learner writes three functions; `sample_tokens_from` (given) makes them one function with
the contract of `kernels/reference.py`'s `sample_tokens`, which a `Sampler` subclass puts in
place of the package's (its `DeviceSampler.sample_tokens`):

    kept_mask(z, top_k, top_p, min_p)                      -> [rows, vocab] bool
    sampling_probs(logits, temperature, top_k, top_p, min_p) -> [rows, vocab] float64
    seeded_draw(probs, seeds, offsets)                      -> [rows] int64

Expected values come from `kernels/reference.py` (`kept_mask`, the race noise of `sample_tokens`)
on the same inputs: masks exactly, probabilities to fp64 rounding, draws token for token.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from minivllm.entrypoints.llm import LLM
from minivllm.kernels import reference
from minivllm.labs import expect, expect_tensor, expect_yours, passed
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.sampling_params import SamplingParams
from minivllm.viz.device import engine_kwargs as device_kwargs


def sample_tokens_from(sampling_probs: Callable, seeded_draw: Callable) -> Callable:
    """A function with `reference.sample_tokens`' contract built from the lab's pieces: greedy
    rows (temperature 0) take the arg-max of their logits, the others `seeded_draw`; the logprob
    is that of the token under the row's probabilities (greedy rows: temperature 1)."""

    def sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets, **hints):
        probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
        drawn = seeded_draw(probs, seeds, offsets)
        tokens = torch.where(temperature == 0, logits.float().argmax(dim=-1), drawn)
        logprobs = probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log().float()
        return tokens, logprobs

    return sample_tokens


# ---------------------------------------------------------------------------------- references
def reference_probs(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """`[rows, vocab]` float64: softmax over the kept tokens of z = logits / T (T = 1 for greedy
    rows), as `reference.sample_tokens` draws from."""
    z = logits.float() / torch.where(temperature == 0, 1.0, temperature.float()).unsqueeze(1)
    kept = reference.kept_mask(z, top_k, top_p, min_p)
    return z.double().masked_fill(~kept, -math.inf).softmax(dim=-1)


def reference_draw(probs: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The package's race on `probs`: arg-max of log p + its noise of (seed, offset)."""
    scores = []
    for row, seed, offset in zip(probs, seeds.tolist(), offsets.tolist()):
        noise = reference.row_race_noise(seed, offset, probs.shape[1], probs.device)
        scores.append(torch.where(row > 0, row.log() + noise, -math.inf))
    return torch.stack(scores).argmax(dim=-1)


def _params(rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Per-row tensors from one value or a list per row."""
    def column(value, dtype):
        values = value if isinstance(value, (list, tuple)) else [value] * rows
        return torch.tensor(values, dtype=dtype)

    return (column(temperature, torch.float32), column(top_k, torch.int64), column(top_p, torch.float32),
            column(min_p, torch.float32))


def _shuffled(probabilities: list[float], seed: int) -> torch.Tensor:
    """`[1, vocab]` logits with these probabilities, at shuffled token ids (a mask must be
    scattered back to token order, not left in sorted order)."""
    order = torch.randperm(len(probabilities), generator=torch.Generator().manual_seed(seed))
    logits = torch.tensor(probabilities).log()[order]
    return logits.unsqueeze(0)


def mask_cases() -> dict[str, tuple]:
    """name -> (z [rows, vocab] fp32, top_k, top_p, min_p)."""
    dist = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
    random_z = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 2.0
    ties = torch.tensor([[1.0, 3.0, 2.0, 0.0, 2.0, -1.0]])
    return {
        "all filters off": (_shuffled(dist, 1), *_params(1)[1:]),
        "top-p = 1.0 is off, even where the running sum rounds to 1":
            (torch.linspace(12.0, -30.0, 24)[torch.randperm(24, generator=torch.Generator().manual_seed(9))]
             .unsqueeze(0), *_params(1)[1:]),
        "top-k = 3": (_shuffled(dist, 2), *_params(1, top_k=3)[1:]),
        "top-k = 2 with a tie at the 2nd value (ties are kept)": (ties, *_params(1, top_k=2)[1:]),
        "top-k >= vocab and top-k = 0 (both off)": (torch.cat([_shuffled(dist, 3)] * 2), *_params(2, top_k=[7, 0])[1:]),
        "top-p = 0.6 (0.4 + 0.25 reaches it: two tokens)": (_shuffled(dist, 4), *_params(1, top_p=0.6)[1:]),
        "top-p = 0.85": (_shuffled(dist, 5), *_params(1, top_p=0.85)[1:]),
        "top-p = 0.01 (the most likely token always stays)": (_shuffled(dist, 6), *_params(1, top_p=0.01)[1:]),
        "top-k = 4 then top-p = 0.8 (over the 4 survivors, renormalized)":
            (_shuffled(dist, 7), *_params(1, top_k=4, top_p=0.8)[1:]),
        "min-p = 0.3 (prob >= 0.3 x the top one)": (_shuffled(dist, 8), *_params(1, min_p=0.3)[1:]),
        "a batch, each row its own filters": (random_z, *_params(6, top_k=[-1, 5, 20, -1, 10, 3],
                                                                  top_p=[1.0, 1.0, 0.7, 0.5, 0.9, 0.2],
                                                                  min_p=[0.0, 0.0, 0.0, 0.1, 0.05, 0.0])[1:]),
    }


def check_kept_mask(kept_mask: Callable) -> None:
    """Each case's mask equal to `reference.kept_mask`'s, token for token."""
    for name, (z, top_k, top_p, min_p) in mask_cases().items():
        expected = reference.kept_mask(z, top_k, top_p, min_p)
        got = kept_mask(z.clone(), top_k, top_p, min_p)
        expect_tensor(got, expected.shape, torch.bool, what=f"case {name!r}: kept_mask")
        for row in range(z.shape[0]):
            want, have = set(expected[row].nonzero().flatten().tolist()), set(got[row].nonzero().flatten().tolist())
            if want != have:
                probs = z[row].softmax(-1)
                expect(False, f"case {name!r}, row {row} (top_k={int(top_k[row])}, top_p={float(top_p[row]):g}, "
                              f"min_p={float(min_p[row]):g}): keeps tokens {sorted(have)}, expected {sorted(want)}; "
                              f"missing {sorted(want - have)}, extra {sorted(have - want)} (token probabilities "
                              f"{[round(p, 3) for p in probs.tolist()] if z.shape[1] <= 8 else '...'})")
    passed(f"kept_mask: {len(mask_cases())} cases equal the package's mask")


def check_sampling_probs(sampling_probs: Callable) -> None:
    """Probabilities after temperature and the filters, against the package's (fp64 rounding)."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 3.0
    cases = {
        "temperature 1, no filters": _params(5),
        "temperature 0.5 (sharper)": _params(5, temperature=0.5),
        "temperature 2.0 (flatter)": _params(5, temperature=2.0),
        "greedy rows (temperature 0 counts as 1)": _params(5, temperature=[0.0, 1.0, 0.0, 0.7, 0.0]),
        "temperature before top-p and min-p": _params(5, temperature=[0.5, 2.0, 0.8, 1.5, 0.3],
                                                      top_k=[-1, 8, -1, 4, -1],
                                                      top_p=[0.8, 0.9, 1.0, 0.95, 0.7],
                                                      min_p=[0.0, 0.0, 0.2, 0.0, 0.05]),
    }
    for name, params in cases.items():
        expected = reference_probs(logits, *params)
        got = sampling_probs(logits.clone(), *params)
        expect_tensor(got, expected.shape, torch.float64, what=f"case {name!r}: sampling_probs")
        for row in range(logits.shape[0]):
            kept_expected, kept_got = expected[row] > 0, got[row] > 0
            if not torch.equal(kept_expected, kept_got):
                expect(False, f"case {name!r}, row {row}: nonzero at {kept_got.nonzero().flatten().tolist()}, expected "
                              f"{kept_expected.nonzero().flatten().tolist()} (temperature first, then the filters on "
                              "z = logits / T)")
            error = (got[row] - expected[row]).abs().max().item()
            if error > 1e-9:
                worst = int((got[row] - expected[row]).abs().argmax())
                why = ("compute the softmax in float64, z.double()" if error < 1e-5
                       else "softmax of logits / T over the kept tokens")
                expect(False, f"case {name!r}, row {row}: token {worst} has probability "
                              f"{got[row, worst].item():.10f}, expected {expected[row, worst].item():.10f} ({why})")
    passed(f"sampling_probs: {len(cases)} cases equal the package's probabilities")


def _chi_square_limit(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile of `dof` degrees of freedom at upper tail 1e-4 (z: the normal
    quantile), by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of drawn tokens against probs `[vocab]`; tokens expected fewer than 5
    times are pooled into one cell. Returns (statistic, degrees of freedom)."""
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * len(tokens)
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    expected_cells = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    nonempty = expected_cells > 0
    statistic = ((observed_cells - expected_cells) ** 2 / expected_cells)[nonempty].sum().item()
    return statistic, int(nonempty.sum()) - 1


def check_seeded_draw(seeded_draw: Callable, num_draws: int = 4000) -> None:
    """Zero-probability tokens never drawn; draws over many positions follow the probabilities
    (chi-square); the seed matters; a row's token depends on its own seed and position only;
    then token for token the package's draw for the same (seed, position)."""
    row = torch.tensor([0.45, 0.25, 0.12, 0.08, 0.05, 0.03, 0.02, 0.0], dtype=torch.float64)
    many = row.expand(num_draws, -1).clone()
    seeds, offsets = torch.full((num_draws,), 1234), torch.arange(num_draws)
    tokens = seeded_draw(many.clone(), seeds, offsets)
    expect_tensor(tokens, (num_draws,), torch.int64, what=f"seeded_draw of {num_draws} rows")
    expect(bool((row[tokens] > 0).all()), "a token of probability 0 was drawn")
    statistic, dof = _chi_square(tokens, row)
    limit = _chi_square_limit(dof)
    expect(statistic < limit, f"{num_draws} draws (one seed, positions 0..{num_draws - 1}) do not follow p = "
                              f"{row.tolist()}: counts {torch.bincount(tokens, minlength=8).tolist()}, chi-square "
                              f"{statistic:.1f} with {dof} degrees of freedom (limit {limit:.1f})")
    other_seed = seeded_draw(many[:64].clone(), torch.full((64,), 99), torch.arange(64))
    expect(not torch.equal(other_seed, tokens[:64]), "seeds 1234 and 99 drew the same 64 tokens: the seed is ignored")
    # Three rows alone, then the same rows inside another batch at other indices.
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0],
                          [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
                          [1 / 6] * 6], dtype=torch.float64)
    seeds, offsets = torch.tensor([7, 123, 2**40 + 5]), torch.tensor([42, 0, 9])
    got = seeded_draw(probs.clone(), seeds, offsets)
    crowd = torch.cat([probs[2:], torch.full((2, 6), 1 / 6, dtype=torch.float64), probs[:1]])
    in_crowd = seeded_draw(crowd, torch.tensor([2**40 + 5, 1, 2, 7]), torch.tensor([9, 5, 6, 42]))
    expect(in_crowd[0] == got[2] and in_crowd[3] == got[0],
           f"a row's token changed with the batch around it: alone {got[[2, 0]].tolist()}, in another batch "
           f"{in_crowd[[0, 3]].tolist()} (use only the row's own seed and position)")
    expected = reference_draw(probs, seeds, offsets)
    expect(torch.equal(got, expected), f"seeds {seeds.tolist()} at positions {offsets.tolist()}: drew {got.tolist()}, "
                                       f"the package draws {expected.tolist()} (the race: arg-max of p / E, E = "
                                       "-log1p(-u), u = torch.rand(vocab, float64) from the generator of "
                                       "mix_seed(seed, position))")
    expect(torch.equal(tokens, reference_draw(many, torch.full((num_draws,), 1234), torch.arange(num_draws))),
           "over many positions the tokens differ from the package's draws for the same seed")
    passed(f"seeded_draw: chi-square {statistic:.1f} < {limit:.1f} over {num_draws} draws, independent of the batch, "
           "the package's tokens for the same seeds")


def check_sample_tokens(sample_tokens: Callable, num_draws: int = 4000) -> None:
    """The whole pipeline (temperature, filters, draw; greedy rows) against
    `reference.sample_tokens`: the same tokens for the same seeds, logprobs to fp32 rounding,
    and draws that follow the expected distribution."""
    logits = torch.randn(8, 96, generator=torch.Generator().manual_seed(2)) * 2.5
    params = _params(8, temperature=[0.0, 1.0, 0.7, 1.3, 0.0, 0.9, 0.5, 2.0], top_k=[-1, -1, 20, -1, 5, 10, -1, 50],
                     top_p=[1.0, 1.0, 0.9, 0.8, 0.5, 1.0, 0.95, 0.6], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0])
    seeds, offsets = torch.arange(100, 108), torch.tensor([5, 17, 3, 40, 8, 0, 11, 2])
    one = logits[2:3].expand(num_draws, -1).clone()
    row_params = [p[2:3].expand(num_draws).clone() for p in params]
    tokens, _ = sample_tokens(one, *row_params, torch.full((num_draws,), 77), torch.arange(num_draws))
    statistic, dof = _chi_square(tokens, reference_probs(logits[2:3], *[p[2:3] for p in params])[0])
    limit = _chi_square_limit(dof)
    expect(statistic < limit, f"{num_draws} draws at temperature 0.7, top-k 20, top-p 0.9 do not follow the expected "
                              f"distribution: chi-square {statistic:.1f}, {dof} degrees of freedom (limit {limit:.1f})")
    expected, expected_logprobs = reference.sample_tokens(logits, *params, seeds, offsets)
    got, got_logprobs = sample_tokens(logits.clone(), *params, seeds, offsets)
    expect(torch.equal(got, expected), f"sample_tokens drew {got.tolist()}, the package {expected.tolist()} "
                                       f"(rows' temperature {params[0].tolist()})")
    error = (got_logprobs - expected_logprobs).abs().max().item()
    expect(error < 1e-4, f"logprobs {got_logprobs.tolist()} differ from the package's {expected_logprobs.tolist()} "
                         f"by up to {error:.2g} (log of the token's probability after temperature and the filters)")
    passed(f"sample_tokens: chi-square {statistic:.1f} < {limit:.1f} over {num_draws} draws; the package's tokens "
           "for 8 mixed rows")


# ---------------------------------------------------------------------------------- the engine
ENGINE_PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "KING HENRY VI:\n", "Nurse:\n")


def seeded_params(max_tokens: int) -> list[SamplingParams]:
    """One request each: greedy, then seeded draws under different filters."""
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return [SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=1.0, seed=11, **common),
            SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=12, **common),
            SamplingParams(temperature=1.2, top_p=0.95, min_p=0.05, seed=13, **common)]


def check_sampler_in_engine(worker_cls: type, sampler_cls: type, max_tokens: int = 12) -> None:
    """`LLM(worker_cls=worker_cls)` (its runner's sampler a `sampler_cls`): greedy output equal to
    transformers'; seeded requests token-identical to the package's own `Sampler` in an engine
    with the same settings, and to themselves run alone."""
    # The package draws with these noises in its PyTorch sampler; the Triton one (a GPU's
    # default) uses Philox: the same distribution, other tokens. So both engines use "torch".
    settings = dict(max_num_seqs=4, max_model_len=256, attention_backend="torch")
    llm = LLM(**device_kwargs(worker_cls=worker_cls, **settings))
    sampler = llm.llm_engine.model_executor.driver_worker.model_runner.sampler
    expect_yours(sampler, sampler_cls, "the engine's sampler", "set self.sampler in the runner's __init__")
    assert_greedy_matches_transformers(ENGINE_PROMPTS, max_tokens, llm=llm)
    params = seeded_params(max_tokens)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(list(ENGINE_PROMPTS), params, use_tqdm=False)]
    package = LLM(**device_kwargs(**settings))
    theirs = [list(o.outputs[0].token_ids) for o in package.generate(list(ENGINE_PROMPTS), params, use_tqdm=False)]
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            position = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            expect(False, f"prompt {index} ({params[index]!r:.60}): token {position} is {a[position]}, the package's "
                          f"Sampler draws {b[position]} for the same seed")
    alone = list(llm.generate(ENGINE_PROMPTS[2], params[2], use_tqdm=False)[0].outputs[0].token_ids)
    expect(alone == ours[2], f"seed 12 drew {alone} alone but {ours[2]} in a batch: a seeded request must not "
                             "depend on the batch")
    passed(f"inside LLM: {len(params) - 1} seeded requests token-identical to the package's Sampler, "
           "and the same alone as in a batch")
