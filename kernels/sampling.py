"""Sampling on the device in one pass over the logits: `sample_tokens` (and `apply_penalties`).

The contracts are `kernels/reference.py`'s (`reference.sample_tokens`, `reference.apply_penalties`),
checked against it by tests/kernels/test_sample_tokens.py and test_penalties.py.

    logits [rows, vocab] --one pass per row slice--> (max, sum of exp, best score, its token)
                         --merge--> token, logprob = z[token] - logsumexp(kept z)

Even a greedy row needs its logsumexp; in PyTorch the arg-max, gather and logsumexp are each
a pass over the logits. The kernel reads each logit once and keeps a few numbers per row (the
online softmax of the attention kernels, over the vocabulary). A random row is the arg-max of
z + noise in the same pass, the noise a Philox function of (seed, offset, token id). Rows with
top-k / top-p / min-p draw among their largest logits (torch.topk, no full sort) in a second
small kernel; a row whose kept set is bigger than those candidates finds its exact cut by
bisection over the row instead (FlashInfer samples by pivots in the same spirit).
`apply_penalties` does the three penalties in one more pass, where PyTorch makes several.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels import reference

_BLOCK = 4096  # logits read per loop iteration (a row is ~37 iterations for a 150k vocabulary)


# --------------------------------------------------------------------------- random sampling
# Candidates taken (by torch.topk) for rows with top-p or min-p but no top-k: enough for
# the nucleus of almost every step of a language model; a row whose kept set may reach
# past them is redone exactly by bisection over its whole row (see `sample_tokens`).
_NUM_CANDIDATES_CAP = 1024
# Candidates taken past the largest top-k: bf16 logits tie often, and tokens tied with the
# k-th value are kept, so the candidates must reach past the k-th to see where the tie ends.
_TIE_SLACK = 32
_CANDIDATE_BLOCK = 1024  # sorted candidates read per loop iteration of the candidate kernel
_MIN_SPLIT_LEN = 4096  # tokens per row slice at least: below, a slice's fixed cost dominates
# What the one-pass kernel does with a row (its `mode`).
_SKIP = tl.constexpr(0)  # nothing: zero loop iterations (its outputs are not used)
_ARGMAX = tl.constexpr(1)  # arg-max of z: greedy rows, and the logsumexp for candidate rows
_DRAW = tl.constexpr(2)  # arg-max of z + noise: a random draw
_TWO_POW_MINUS_32 = tl.constexpr(2.3283064365386963e-10)  # constexpr: a global a kernel may read


@triton.jit
def _race_noise(seed, offset, token):
    """-log(E) with E ~ Exp(1), a function of (seed, offset, token id) alone, for a block of
    token ids: arg-max(z + noise) over tokens draws from softmax(z) (the exponential race,
    or Gumbel-max), and a row's draw never depends on which batch it sits in.

    Philox4x32 keyed by the 64-bit seed, counter (token, offset low 32 bits, offset high 32
    bits, 0): every (seed, offset, token) gets its own random words, with no overflow.
    """
    token = token.to(tl.uint32)
    zero = token * 0
    offset_lo = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    offset_hi = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    r0, r1, _, _ = tl.philox(seed, token, offset_lo, offset_hi, zero)
    # c uniform in (0, 1) from two words: resolution 2^-64 near 0, where E = -log(1 - c) is
    # small and the noise is large (the draws that decide rare tokens). One word's 2^-24
    # float spacing would clip the noise at 16.6 and skew a 150k-token row about 1 % of the time.
    c = (r0.to(tl.float32) + (r1.to(tl.float32) + 0.5) * _TWO_POW_MINUS_32) * _TWO_POW_MINUS_32
    u = 1.0 - c
    # E = -log1p(-c) to full precision with only log (Kahan's trick: log(u) * c / (1 - u)).
    exponential = tl.where(u == 1.0, c, -tl.log(u) * c / (1.0 - u))
    return -tl.log(exponential)


@triton.jit
def _sample_row_kernel(logits_ptr, temperature_ptr, threshold_ptr, mode_ptr, seeds_ptr, offsets_ptr, partial_ptr,
                       partial_best_ptr, vocab_size, stride_row, split_len, BLOCK: tl.constexpr):
    """Grid (rows, splits): one pass over one slice of a row's logits. z = logits / T, kept
    where z >= the row's threshold (-inf: all); the running arg-max of z + noise (of z alone
    in mode _ARGMAX: first index among ties) and the online max and sum of exp of the kept z.
    Writes those partials (max, sum, best score, its z; its token) for `_merge_splits_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    temperature = tl.load(temperature_ptr + row)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    threshold = tl.load(threshold_ptr + row)
    mode = tl.load(mode_ptr + row)
    draw = mode == _DRAW
    row_len = tl.where(mode == _SKIP, 0, vocab_size)  # a skipped row's loop runs zero times
    first = split * split_len
    end = tl.minimum(first + split_len, row_len)
    seed = tl.load(seeds_ptr + row)
    offset = tl.load(offsets_ptr + row)
    cols = tl.arange(0, BLOCK)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    best_score = tl.full((), float("-inf"), tl.float32)
    best_z = tl.full((), float("-inf"), tl.float32)
    best = tl.zeros((), tl.int64)
    for start in range(first, end, BLOCK):
        mask = start + cols < end
        z = tl.load(logits_ptr + row * stride_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        z = z / temperature
        z = tl.where(z >= threshold, z, float("-inf"))
        block_max = tl.max(z, axis=0)
        new_max = tl.maximum(running_max, block_max)
        # exp(-inf - -inf) is NaN: while nothing is kept (a block or a whole slice below the
        # threshold) there is nothing to rescale or add.
        rescale = tl.where(running_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
        running_sum = running_sum * rescale + tl.sum(tl.where(z == float("-inf"), 0.0, tl.exp(z - new_max)), axis=0)
        running_max = new_max
        score = z
        if draw:  # greedy rows skip the random numbers
            score = z + _race_noise(seed, offset, start + cols)
        block_best = tl.argmax(score, axis=0)
        block_score = tl.max(score, axis=0)
        block_z = tl.max(tl.where(cols == block_best, z, float("-inf")), axis=0)
        better = block_score > best_score  # strict: the first max wins, as torch.argmax
        best = tl.where(better, block_best.to(tl.int64) + start, best)
        best_z = tl.where(better, block_z, best_z)
        best_score = tl.where(better, block_score, best_score)
    slot = row * num_splits + split
    tl.store(partial_ptr + slot * 4 + 0, running_max)
    tl.store(partial_ptr + slot * 4 + 1, running_sum)
    tl.store(partial_ptr + slot * 4 + 2, best_score)
    tl.store(partial_ptr + slot * 4 + 3, best_z)
    tl.store(partial_best_ptr + slot, best)


# Batch-dependent int arguments: not specialized (why: kernels/paged_attention.py, v1).
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(partial_ptr, partial_best_ptr, tokens_ptr, logprobs_ptr, lse_ptr, num_splits,
                         SPLITS: tl.constexpr):
    """One program per row: merge its slices' partials. The logsumexp of the kept z from the
    slices' (max, sum) pairs; the token of the best score, the earliest slice among ties (so
    the first index overall, as torch.argmax). Writes the token, z[token] - logsumexp, and
    logsumexp."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS)
    valid = splits < num_splits
    slot = row * num_splits + splits
    maxes = tl.load(partial_ptr + slot * 4 + 0, mask=valid, other=float("-inf"))
    sums = tl.load(partial_ptr + slot * 4 + 1, mask=valid, other=0.0)
    scores = tl.load(partial_ptr + slot * 4 + 2, mask=valid, other=float("-inf"))
    zs = tl.load(partial_ptr + slot * 4 + 3, mask=valid, other=float("-inf"))
    bests = tl.load(partial_best_ptr + slot, mask=valid, other=0)
    row_max = tl.max(maxes, axis=0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - row_max))
    lse = row_max + tl.log(tl.sum(sums * weights, axis=0))
    pick = tl.argmax(scores, axis=0, tie_break_left=True)
    best = tl.sum(tl.where(splits == pick, bests, 0), axis=0)
    best_z = tl.max(tl.where(splits == pick, zs, float("-inf")), axis=0)
    tl.store(tokens_ptr + row, best)
    tl.store(logprobs_ptr + row, best_z - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit(do_not_specialize=["num_candidates"])
def _sample_candidates_kernel(values_ptr, indices_ptr, lse_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                              seeds_ptr, offsets_ptr, tokens_ptr, logprobs_ptr, overflow_ptr,
                              num_candidates, vocab_size, BLOCK: tl.constexpr):
    """One row per program over its `num_candidates` largest z, sorted descending (values)
    with their token ids (indices): the top-k, top-p and min-p masks, the race over the kept
    candidates, z[token] - logsumexp(kept z), and whether the kept set may reach past the
    candidates (then `_exact_threshold_kernel` redoes the row, unless the candidates are the
    whole vocabulary)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * num_candidates
    z_max = tl.load(values_ptr + base)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    greedy = tl.load(temperature_ptr + row) == 0.0
    seed = tl.load(seeds_ptr + row)
    offset = tl.load(offsets_ptr + row)
    top_k_on = (k > 0) & (k < vocab_size)
    kth = tl.load(values_ptr + base + tl.minimum(tl.maximum(k, 1), num_candidates) - 1)
    # A k past the candidates keeps all of them (and the row is flagged below).
    kth = tl.where(top_k_on & (k <= num_candidates), kth, float("-inf"))
    top_p = tl.where(top_p >= 1.0, float("inf"), top_p)  # off: keep even if rounding sums past 1
    cols = tl.arange(0, BLOCK)
    # top-p's probabilities are over the top-k survivors (as in the host sampler), else over
    # the whole row (whose logsumexp came from the one-pass kernel): first their sum.
    top_k_sum = tl.zeros((), tl.float32)
    for start in range(0, num_candidates, BLOCK):
        v = tl.load(values_ptr + base + start + cols, mask=start + cols < num_candidates, other=float("-inf"))
        top_k_sum += tl.sum(tl.where(v >= kth, tl.exp(v - z_max), 0.0), axis=0)
    normalizer = tl.where(top_k_on, top_k_sum, tl.exp(tl.load(lse_ptr + row) - z_max))
    mass_before = tl.zeros((), tl.float32)  # of the candidates already seen
    kept_sum = tl.zeros((), tl.float32)
    best_score = tl.full((), float("-inf"), tl.float32)
    best_z = tl.full((), float("-inf"), tl.float32)
    best = tl.zeros((), tl.int64)
    for start in range(0, num_candidates, BLOCK):
        i = start + cols
        valid = i < num_candidates
        v = tl.load(values_ptr + base + i, mask=valid, other=float("-inf"))
        token = tl.load(indices_ptr + base + i, mask=valid, other=0)
        relative = tl.exp(v - z_max)  # prob / max prob
        in_top_k = valid & (v >= kth)
        prob = tl.where(in_top_k, relative / normalizer, 0.0)
        before = mass_before + tl.cumsum(prob, axis=0) - prob
        mass_before += tl.sum(prob, axis=0)
        in_top_p = (before < top_p) | (i == 0)
        in_min_p = relative >= min_p
        kept = in_top_k & in_top_p & in_min_p
        kept_sum += tl.sum(tl.where(kept, relative, 0.0), axis=0)
        score = v
        if not greedy:
            score = v + _race_noise(seed, offset, token)
        score = tl.where(kept, score, float("-inf"))
        block_best = tl.argmax(score, axis=0)
        block_score = tl.max(score, axis=0)
        better = block_score > best_score
        best = tl.where(better, tl.max(tl.where(cols == block_best, token, -1), axis=0).to(tl.int64), best)
        best_z = tl.where(better, tl.max(tl.where(cols == block_best, v, float("-inf")), axis=0), best_z)
        best_score = tl.where(better, block_score, best_score)
    # The last candidate kept means tokens past it may be kept too. With top-k on, a tie at
    # the k-th value reaching the last candidate also leaves top-p's normalizer short, so
    # top-p's verdict on it cannot be trusted: flag it whatever top-p says.
    last = tl.load(values_ptr + base + num_candidates - 1)
    last_in_top_k = last >= kth
    last_prob = tl.where(last_in_top_k, tl.exp(last - z_max) / normalizer, 0.0)
    last_in_top_p = mass_before - last_prob < top_p
    last_in_min_p = tl.exp(last - z_max) >= min_p
    overflow = last_in_top_k & last_in_min_p & (last_in_top_p | top_k_on)
    tl.store(tokens_ptr + row, best)
    tl.store(logprobs_ptr + row, best_z - z_max - tl.log(kept_sum))
    tl.store(overflow_ptr + row, overflow.to(tl.int8))


@triton.jit
def _sortable_key(z):
    """fp32 -> int32 with the same order (negative floats' magnitude bits flipped)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _largest_key_reaching(row_ptr, row_len, temperature, floor, z_max, target, BY_MASS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """The largest z such that the tokens with z >= it and >= floor number (or, BY_MASS,
    weigh in exp(z - z_max)) at least `target`: always one of the row's own values, found
    exactly by halving the int32 range of `_sortable_key`s 32 times, one pass each."""
    cols = tl.arange(0, BLOCK)
    low = tl.full((), -(2**31), tl.int64)  # reaches the target (every token counts)
    high = tl.full((), 2**31, tl.int64)  # does not (no token counts)
    for _ in range(32):
        middle = (low + high) >> 1
        total = tl.zeros((), tl.float32)
        for start in range(0, row_len, BLOCK):
            valid = start + cols < row_len
            z = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32) / temperature
            counted = valid & (_sortable_key(z) >= middle) & (z >= floor)
            weight = tl.full((BLOCK,), 1.0, tl.float32)
            if BY_MASS:
                weight = tl.exp(z - z_max)
            total += tl.sum(tl.where(counted, weight, 0.0), axis=0)
        reaches = total >= target
        low = tl.where(reaches, middle, low)
        high = tl.where(reaches, high, middle)
    bits = low.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _exact_threshold_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, active_ptr,
                            threshold_ptr, vocab_size, stride_row, BLOCK: tl.constexpr):
    """For the rows whose kept set reached past their candidates: the smallest kept z over
    the whole row, with no sort, so that kept = z >= threshold. The k-th largest z (top-k,
    ties kept), the smallest z whose more-or-equally likely tokens reach mass top_p (top-p
    over the top-k survivors), the smallest z with exp(z - z_max) >= min_p (min-p): about
    70 passes over the row, paid only by active rows (the others loop zero times)."""
    row = tl.program_id(0).to(tl.int64)
    row_len = tl.where(tl.load(active_ptr + row) != 0, vocab_size, 0)
    row_ptr = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    cols = tl.arange(0, BLOCK)
    z_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, row_len, BLOCK):
        z = tl.load(row_ptr + start + cols, mask=start + cols < row_len, other=float("-inf")).to(tl.float32)
        z_max = tl.maximum(z_max, tl.max(z / temperature, axis=0))
    kth = tl.full((), float("-inf"), tl.float32)
    if (k > 0) & (k < vocab_size):
        kth = _largest_key_reaching(row_ptr, row_len, temperature, kth, z_max, k.to(tl.float32), False, BLOCK)
    top_p_cut = tl.full((), float("-inf"), tl.float32)
    if top_p < 1.0:
        # top-p's probabilities are over the top-k survivors: their total, relative to z_max.
        total = tl.zeros((), tl.float32)
        for start in range(0, row_len, BLOCK):
            z = tl.load(row_ptr + start + cols, mask=start + cols < row_len, other=float("-inf")).to(tl.float32)
            z = z / temperature
            total += tl.sum(tl.where(z >= kth, tl.exp(z - z_max), 0.0), axis=0)
        top_p_cut = _largest_key_reaching(row_ptr, row_len, temperature, kth, z_max, top_p * total, True, BLOCK)
    min_p_cut = tl.full((), float("inf"), tl.float32)
    for start in range(0, row_len, BLOCK):
        z = tl.load(row_ptr + start + cols, mask=start + cols < row_len, other=float("-inf")).to(tl.float32)
        z = z / temperature
        min_p_cut = tl.minimum(min_p_cut, tl.min(tl.where(tl.exp(z - z_max) >= min_p, z, float("inf")), axis=0))
    tl.store(threshold_ptr + row, tl.maximum(tl.maximum(kth, top_p_cut), min_p_cut))


@triton.jit
def _race_noise_kernel(seeds_ptr, offsets_ptr, out_ptr, num_tokens, BLOCK: tl.constexpr):
    """Grid (rows, blocks of token ids): `_race_noise` of token ids 0..num_tokens - 1 of each row."""
    row = tl.program_id(0).to(tl.int64)
    token = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    noise = _race_noise(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row), token)
    tl.store(out_ptr + row * num_tokens + token, noise, mask=token < num_tokens)


def race_noise(seeds: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The noise `sample_tokens` adds to z, `[rows, num_tokens]` fp32: the contract of
    `reference.race_noise`."""
    out = torch.empty(seeds.shape[0], num_tokens, dtype=torch.float32, device=seeds.device)
    if out.numel():
        block = _block(num_tokens)
        _race_noise_kernel[(seeds.shape[0], triton.cdiv(num_tokens, block))](seeds, offsets, out, num_tokens,
                                                                             BLOCK=block)
    return out


# --------------------------------------------------------------------------- penalties
_PENALTY_BLOCK = 2048  # tokens per program: ~75 programs a row for a 150k vocabulary


@triton.jit
def _apply_penalties_kernel(logits_ptr, prompt_mask_ptr, counts_ptr, repetition_ptr, frequency_ptr, presence_ptr,
                            out_ptr, vocab_size, stride_logits, stride_mask, stride_counts, BLOCK: tl.constexpr):
    """Grid (rows, blocks of the vocabulary): one read of each input and one write of the
    fp32 result, where the PyTorch version makes ~15 passes over `[rows, vocab]` tensors."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    logits = tl.load(logits_ptr + row * stride_logits + cols, mask=inside, other=0.0).to(tl.float32)
    in_prompt = tl.load(prompt_mask_ptr + row * stride_mask + cols, mask=inside, other=0) != 0
    counts = tl.load(counts_ptr + row * stride_counts + cols, mask=inside, other=0.0)
    repetition = tl.load(repetition_ptr + row)
    in_output = counts > 0
    # div_rn: IEEE division, as torch's (Triton's default `/` may be approximate on a GPU).
    penalized = tl.where(logits > 0, tl.math.div_rn(logits, repetition), logits * repetition)
    logits = tl.where(in_prompt | in_output, penalized, logits)
    logits = logits - tl.load(frequency_ptr + row) * counts
    logits = logits - tl.load(presence_ptr + row) * in_output.to(tl.float32)
    tl.store(out_ptr + row * vocab_size + cols, logits, mask=inside)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties in one kernel: the contract of
    `reference.apply_penalties` (shapes there). Returns new `[rows, vocab]` fp32 logits."""
    num_rows, vocab_size = logits.shape
    for name, stats in (("prompt_mask", prompt_mask), ("output_counts", output_counts)):
        if stats.shape != logits.shape or stats.stride(1) != 1:
            raise ValueError(f"{name} must be {tuple(logits.shape)} with unit stride on the vocabulary, "
                             f"got {tuple(stats.shape)} and strides {stats.stride()}.")
    if logits.stride(1) != 1 or output_counts.dtype != torch.float32 or prompt_mask.dtype != torch.bool:
        raise ValueError("logits need unit stride on the vocabulary, output_counts fp32 and prompt_mask bool.")
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    block = min(_PENALTY_BLOCK, triton.next_power_of_2(vocab_size))
    grid = (num_rows, triton.cdiv(vocab_size, block))
    _apply_penalties_kernel[grid](logits, prompt_mask.view(torch.int8), output_counts, repetition.float(),
                                  frequency.float(), presence.float(), out, vocab_size, logits.stride(0),
                                  prompt_mask.stride(0), output_counts.stride(0), BLOCK=block)
    return out


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
                  needs_truncation: bool | None = None,
                  num_candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob, on the device: the contract of `reference.sample_tokens`,
    drawn with Philox noise. Truncating rows draw among their `num_candidates` largest z; a row
    whose kept set may reach past them is redone exactly (its threshold by bisection, then the
    one-pass kernel over z >= threshold); those kernels always launch, other rows loop zero
    times in them, so with both hints given nothing here waits for the device. (Top-p ties: a
    token tied with the last one the nucleus needs is kept here, where a sort keeps some.)

    Args:
        logits: `[rows, vocab]` float (bf16/fp16/fp32), unit stride on the vocabulary.
        temperature, top_p, min_p: `[rows]` fp32 (0 = greedy; 1.0 = off; 0.0 = off).
        top_k: `[rows]` int32/int64 (<= 0 or >= vocab = off).  seeds, offsets: `[rows]` int64
            (offsets >= 0: the index of the token being drawn in its sequence). Values are
            not checked (that would read them on the host): `SamplingParams` checks them.
        needs_truncation: host-side hint, whether any row has top-k, top-p or min-p. None:
            computed from the tensors (a host sync). False with truncating rows ignores them.
        num_candidates: host-side hint, the candidates per row for the truncation path. None:
            the largest top-k + 32 if every truncating row has a top-k, else at least 1024
            (computed from the tensors: a host sync).
    Returns:
        tokens `[rows]` int64 and logprobs `[rows]` fp32, on the logits' device.
    """
    reference.check_sample_tokens_args(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    num_rows, vocab_size = logits.shape
    temperature, top_p, min_p = temperature.float(), top_p.float(), min_p.float()
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return tokens, logprobs
    # With the host's word that no row truncates, the masks (six kernels) are not built.
    truncates = None if needs_truncation is False else (
        ((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0.0))
    if needs_truncation is None:
        needs_truncation = bool(truncates.any())
    # Rows the candidate kernel draws need only the logsumexp from this pass: no noise.
    draw = (temperature != 0) & ~truncates if needs_truncation else temperature != 0
    everything = torch.full((num_rows,), -float("inf"), device=logits.device)
    _sample_rows(logits, temperature, everything, _mode(draw, True), seeds, offsets, tokens, logprobs, lse)
    if not needs_truncation:
        return tokens, logprobs
    if num_candidates is None:
        num_candidates = _num_candidates(top_k, truncates, vocab_size)
    num_candidates = min(num_candidates, vocab_size)
    cand_tokens, cand_logprobs, overflow = _sample_candidates(logits, lse, temperature, top_k, top_p, min_p, seeds,
                                                              offsets, num_candidates)
    if num_candidates < vocab_size:  # the rows whose kept set may reach past the candidates
        redo = overflow & truncates
        threshold = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        _exact_threshold_kernel[(num_rows,)](logits, temperature, top_k, top_p, min_p, redo.to(torch.int8), threshold,
                                             vocab_size, logits.stride(0), BLOCK=_block(vocab_size))
        redo_tokens, redo_logprobs = torch.empty_like(tokens), torch.empty_like(logprobs)
        _sample_rows(logits, temperature, threshold, _mode(temperature != 0, redo), seeds, offsets,
                     redo_tokens, redo_logprobs, torch.empty_like(lse))
        cand_tokens = torch.where(redo, redo_tokens, cand_tokens)
        cand_logprobs = torch.where(redo, redo_logprobs, cand_logprobs)
    # Greedy rows keep the one-pass arg-max (the first index among ties, which topk's order
    # does not promise); every truncating row takes the logprob of its kept set.
    tokens = torch.where(truncates & (temperature != 0), cand_tokens, tokens)
    return tokens, torch.where(truncates, cand_logprobs, logprobs)


def _block(vocab_size: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(vocab_size))  # small vocabularies: small blocks


def _mode(draw: torch.Tensor, active: torch.Tensor | bool) -> torch.Tensor:
    """`[rows]` int8 mode of the one-pass kernel: _DRAW where draw, else _ARGMAX; _SKIP where not active."""
    mode = torch.where(draw, _DRAW.value, _ARGMAX.value).to(torch.int8)
    return mode if active is True else torch.where(active, mode, _SKIP.value).to(torch.int8)


def _sample_rows(logits, temperature, threshold, mode, seeds, offsets, tokens, logprobs, lse) -> None:
    """The one-pass kernel over row slices, then the merge of their partials."""
    num_rows, vocab_size = logits.shape
    block = _block(vocab_size)
    num_splits = _num_row_splits(num_rows, vocab_size, logits.device)
    split_len = triton.cdiv(triton.cdiv(vocab_size, num_splits), block) * block  # whole blocks per slice
    partials = torch.empty(num_rows * num_splits * 4, dtype=torch.float32, device=logits.device)
    partial_best = torch.empty(num_rows * num_splits, dtype=torch.int64, device=logits.device)
    _sample_row_kernel[(num_rows, num_splits)](logits, temperature, threshold, mode, seeds, offsets, partials,
                                               partial_best, vocab_size, logits.stride(0), split_len, BLOCK=block)
    # SPLITS from the vocabulary, not the batch: one compiled merge kernel per model.
    _merge_splits_kernel[(num_rows,)](partials, partial_best, tokens, logprobs, lse, num_splits,
                                      SPLITS=triton.next_power_of_2(max(num_splits, _max_row_splits(vocab_size))))


def _num_row_splits(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Slices per row: one when the rows alone fill the GPU (a large batch); else one program
    would read a whole 151,936-token row alone, so a small batch cuts its rows into slices of
    at least `_MIN_SPLIT_LEN` tokens until there are about two programs per SM."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_rows >= num_sms:
        return 1
    return max(1, min(_max_row_splits(vocab_size), triton.cdiv(2 * num_sms, num_rows)))


def _max_row_splits(vocab_size: int) -> int:
    return triton.cdiv(vocab_size, _MIN_SPLIT_LEN)


def _num_candidates(top_k: torch.Tensor, truncates: torch.Tensor, vocab_size: int) -> int:
    """The largest top-k + `_TIE_SLACK`, and at least the cap if a truncating row has no top-k."""
    top_k_on = (top_k > 0) & (top_k < vocab_size)
    largest_k, any_without_k = torch.stack([torch.where(top_k_on, top_k, 0).max(),
                                            (truncates & ~top_k_on).any().long()]).tolist()
    return min(vocab_size, largest_k + _TIE_SLACK if not any_without_k else max(largest_k + _TIE_SLACK, _NUM_CANDIDATES_CAP))


def _sample_candidates(logits, lse, temperature, top_k, top_p, min_p, seeds, offsets, num_candidates):
    """The candidate kernel over each row's `num_candidates` largest z: tokens, logprobs, overflow."""
    num_rows = logits.shape[0]
    # topk on the raw logits (half the bytes for bf16); dividing by T > 0 keeps their order.
    values, indices = torch.topk(logits, num_candidates, dim=-1, sorted=True)
    scale = torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    values = (values.float() / scale).contiguous()
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    overflow = torch.empty(num_rows, dtype=torch.int8, device=logits.device)
    _sample_candidates_kernel[(num_rows,)](values, indices.contiguous(), lse, temperature, top_k, top_p, min_p,
                                           seeds, offsets, tokens, logprobs, overflow, num_candidates,
                                           logits.shape[1], BLOCK=min(_CANDIDATE_BLOCK, triton.next_power_of_2(num_candidates)))
    return tokens, logprobs, overflow.bool()
