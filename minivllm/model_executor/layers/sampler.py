"""From logits to the next token of every sequence: `Sampler`.

Mirrors `vllm/model_executor/layers/sampler.py` (v0). One call handles the whole batch, in
the order vLLM v0 applies things:

    0. logits processors  `SamplingParams.logits_processors`, each row's own (vLLM's hook)
    1. min_tokens       stop tokens (EOS, `stop_token_ids`) get -inf until enough tokens exist
    2. penalties        repetition (prompt + output), frequency and presence (output only)
    3. temperature      logits / T (greedy and beam rows use T = 1)
    4. top-k, top-p     keep the k largest, then the smallest set with probability >= p
    5. min-p            drop tokens less likely than min_p x the most likely one
    6. choose           greedy arg-max | random (per-request seeded generator) | beam search

Logprobs are those of the distribution after steps 1-5 (what was sampled from; vLLM v0 does
the same). Prompt logprobs are the model's raw distribution (no penalties or temperature).

Beam search (vLLM 0.6 v0, the paper's section 4.4): for each request the sampler proposes
the `2 * beam_width` best (parent beam, token) pairs by cumulative logprob; the engine keeps
`beam_width` of them alive, forking parents that win several children (copy-on-write shares
their KV blocks) and freeing parents that win none.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels import reference
from minivllm.model_executor.layers.device_sampler import DeviceSampler
from minivllm.model_executor.sampling_metadata import SamplingMetadata, SequenceGroupToSample, token_counts
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import SamplerOutput, SequenceData, SequenceGroupOutput, SequenceOutput

# A beam-search step proposes twice the beam width, so that even if every beam_width best
# candidates end in EOS, beam_width candidates can still continue (as in transformers).
_BEAM_CANDIDATE_FACTOR = 2


class Sampler(nn.Module):
    """Turn selected logits rows into one `SequenceGroupOutput` per scheduled request.

    Requests with one sequence and no beams or logits processors (nearly all) are sampled on
    the logits' device by `DeviceSampler` (one kernel for the whole batch, one copy back);
    the others (beam search, parallel sampling (`n > 1`), Python logits processors) by the host
    code below, the steps of the module docstring written out one by one.

    Args:
        backend: "torch" or "triton", the kernels' backend; the same setting as the model's
            attention.
    """

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self.device_sampler = DeviceSampler(backend)

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """
        Args:
            logits: `[num_selected, vocab_size]`, rows as in `sampling_metadata` (fp32 from the
                model runner; other float dtypes are upcast).
        Returns:
            one `SequenceGroupOutput` per entry of `sampling_metadata.seq_groups`.
        """
        groups = sampling_metadata.seq_groups
        outputs = [SequenceGroupOutput(samples=[]) for _ in groups]
        for group, output in zip(groups, outputs):
            if group.prompt_logprob_indices:
                output.prompt_logprobs, output.prompt_ranks = _prompt_logprobs(logits.float(), group)
        on_device = [g.do_sample and _on_device(g) for g in groups]
        device_groups = [(g, o) for g, o, d in zip(groups, outputs, on_device) if d]
        host_groups = [(g, o) for g, o, d in zip(groups, outputs, on_device) if g.do_sample and not d]
        if device_groups:
            self._sample_on_device(logits, *zip(*device_groups))
        if host_groups:
            self._sample_on_host(logits, *zip(*host_groups))
        return SamplerOutput(outputs)

    def _sample_on_device(self, logits: torch.Tensor, groups: tuple, outputs: tuple) -> None:
        rows = [row for group in groups for row in group.sample_indices]
        sample_logits = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tensors = self.device_sampler.prepare(list(groups), logits.shape[-1], logits.device)
        drawn = self.device_sampler(sample_logits, tensors).to_host()  # the step's one host sync
        for output, samples in zip(outputs, drawn.sequence_outputs(list(groups), tensors)):
            output.samples = samples

    def _sample_on_host(self, logits: torch.Tensor, groups: tuple, outputs: tuple) -> None:
        """Beam search, parallel sampling (n > 1), logits processors (module docstring)."""
        sample_rows = [row for group in groups for row in group.sample_indices]
        # fp32 from here: a softmax in fp16 underflows, and 0 / 0 in the exponential race is NaN.
        sample_logits = process_logits(logits[sample_rows].float(), list(groups))
        logprobs = torch.log_softmax(sample_logits, dim=-1)
        # One token per row for the whole batch at once (few kernel launches, one host sync).
        row_tokens = choose_tokens(sample_logits, list(groups))
        row_token_logprobs = logprobs.gather(1, row_tokens.unsqueeze(1)).squeeze(1)
        chosen = list(zip(row_tokens.tolist(), row_token_logprobs.tolist()))
        row = 0
        for group, output in zip(groups, outputs):
            rows = slice(row, row + len(group.sample_indices))
            output.samples = _sample_group(group, sample_logits[rows], logprobs[rows], chosen[rows])
            row += len(group.sample_indices)


def _on_device(group: SequenceGroupToSample) -> bool:
    return DeviceSampler.can_sample_group(group)


# --------------------------------------------------------------------------- logits processing
def process_logits(logits: torch.Tensor, groups: list[SequenceGroupToSample]) -> torch.Tensor:
    """Steps 1-5 of the module docstring on `[num_sample_rows, vocab]` logits (in place)."""
    rows = [(group, seq_id) for group in groups if group.do_sample for seq_id in _row_seq_ids(group)]
    logits = apply_logits_processors(logits, rows)
    logits = apply_min_tokens(logits, rows)
    logits = apply_penalties(logits, rows)
    params = [group.sampling_params for group, _ in rows]
    temperatures = [p.temperature if p.sampling_type in _RANDOM_TYPES else 1.0 for p in params]
    logits = logits / logits.new_tensor(temperatures).unsqueeze(1)
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if any(k != -1 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = apply_top_k_top_p(logits, torch.tensor(top_ks), logits.new_tensor(top_ps))
    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        logits = apply_min_p(logits, logits.new_tensor(min_ps))
    return logits


_RANDOM_TYPES = (SamplingType.RANDOM, SamplingType.RANDOM_SEED)


def _row_seq_ids(group: SequenceGroupToSample) -> list[int]:
    """The sequence whose tokens each sample row continues (a prompt row: the one sequence)."""
    return group.seq_ids[: len(group.sample_indices)]


def apply_logits_processors(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Each row through its request's processors, in order: `f(output_ids, logits)` or
    `f(prompt_ids, output_ids, logits)` (vLLM's two forms, told apart by their arity)."""
    for i, (group, seq_id) in enumerate(rows):
        data = group.seq_data[seq_id]
        for processor in group.sampling_params.logits_processors:
            if _num_positional(processor) == 3:
                logits[i] = processor(list(data.prompt_token_ids), list(data.output_token_ids), logits[i])
            else:
                logits[i] = processor(list(data.output_token_ids), logits[i])
    return logits


def _num_positional(function) -> int:
    import inspect

    parameters = inspect.signature(function).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def apply_min_tokens(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Forbid stop tokens (EOS unless `ignore_eos`, `stop_token_ids`) before `min_tokens`."""
    for i, (group, seq_id) in enumerate(rows):
        params = group.sampling_params
        if group.seq_data[seq_id].get_output_len() < params.min_tokens:
            stop_ids = list(params.all_stop_token_ids)
            if stop_ids:
                logits[i, stop_ids] = -float("inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; frequency and presence over output.

    repetition (as in CTRL and transformers): a seen token's logit is divided by the penalty
    when positive and multiplied by it when negative. frequency: minus penalty x count.
    presence: minus penalty once if the token appeared (OpenAI's definitions).
    """
    params = [group.sampling_params for group, _ in rows]
    if all(
        p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
        for p in params
    ):
        return logits  # the common case: skip building [rows, vocab] count tensors
    vocab_size = logits.shape[1]
    datas = [group.seq_data[seq_id] for group, seq_id in rows]
    output_counts = token_counts([d.output_token_ids for d in datas], vocab_size, logits.device)
    prompt_counts = token_counts([d.prompt_token_ids for d in datas], vocab_size, logits.device)
    penalties = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                             device=logits.device)
    return reference.apply_penalties(logits, prompt_counts > 0, output_counts, *penalties.T)


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


# --------------------------------------------------------------------------- choosing tokens
def choose_tokens(logits: torch.Tensor, groups: list[SequenceGroupToSample]) -> torch.Tensor:
    """`[num_sample_rows]` token ids: arg-max for greedy rows, a random draw for the others.

    A random draw is argmax(p / E) with E ~ Exp(1) (the "exponential race", as in vLLM): it
    samples from p with no cumulative-sum search, and each seeded request re-draws its own
    rows' E from its generator, so its tokens do not depend on what else is in the batch.
    """
    tokens = logits.argmax(dim=-1)
    types = [g.sampling_params.sampling_type for g in groups for _ in g.sample_indices]
    if all(t not in _RANDOM_TYPES for t in types):
        return tokens
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    row = 0
    for group in groups:
        num_rows = len(group.sample_indices)
        if group.generator is not None and num_rows:
            noise[row : row + num_rows].exponential_(generator=group.generator)
        row += num_rows
    # exponential_() may return exactly 0; 0 / 0 would be NaN, and NaN wins an arg-max, so
    # a token of probability 0 could be drawn. The smallest positive noise keeps it at 0.
    random_tokens = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    is_random = torch.tensor([t in _RANDOM_TYPES for t in types], device=logits.device)
    return torch.where(is_random, random_tokens, tokens)


def _sample_group(
    group: SequenceGroupToSample,
    logits: torch.Tensor,
    logprobs: torch.Tensor,
    chosen: list[tuple[int, float]],
) -> list[SequenceOutput]:
    """This request's samples. logits/logprobs: `[rows, vocab]`; chosen: (token, logprob) per row."""
    params = group.sampling_params
    if params.sampling_type == SamplingType.BEAM:
        parents, tokens = _beam_search_candidates(group, logprobs)
    elif group.is_first_sample and params.best_of > 1:
        # One prompt row fans out into best_of independent samples (the engine forks).
        parents = [0] * params.best_of
        extra = _draw(logits[0], params.best_of - 1, params.sampling_type, group.generator)
        tokens = [chosen[0][0]] + extra
    else:
        return [
            _make_output(seq_id, token, value, logprobs[i], params.logprobs)
            for i, (seq_id, (token, value)) in enumerate(zip(group.seq_ids, chosen))
        ]
    return [
        _make_output(group.seq_ids[p], t, float(logprobs[p, t]), logprobs[p], params.logprobs)
        for p, t in zip(parents, tokens)
    ]


def _draw(logits: torch.Tensor, num_samples: int, sampling_type: SamplingType, generator) -> list[int]:
    """`num_samples` more token ids from one row (with replacement, as in vLLM)."""
    if sampling_type == SamplingType.GREEDY:
        return [int(logits.argmax())] * num_samples
    probs = logits.softmax(dim=-1).expand(num_samples, -1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1).tolist()


def _beam_search_candidates(
    group: SequenceGroupToSample, logprobs: torch.Tensor
) -> tuple[list[int], list[int]]:
    """The 2 x beam_width best (parent row, token) pairs by cumulative logprob."""
    num_candidates = _BEAM_CANDIDATE_FACTOR * group.sampling_params.best_of
    if group.is_first_sample:
        # All beams start from the same prompt: take the best tokens of its single row.
        tokens = torch.topk(logprobs[0], num_candidates).indices.tolist()
        return [0] * num_candidates, tokens
    cumulative = logprobs.new_tensor(
        [group.seq_data[seq_id].cumulative_logprob for seq_id in _row_seq_ids(group)]
    )
    scores = (logprobs + cumulative.unsqueeze(1)).flatten()
    flat = torch.topk(scores, num_candidates).indices.tolist()
    vocab_size = logprobs.shape[-1]
    return [i // vocab_size for i in flat], [i % vocab_size for i in flat]


def _make_output(
    parent_seq_id: int,
    token: int,
    token_logprob: float,
    row_logprobs: torch.Tensor,
    num_logprobs: int | None,
) -> SequenceOutput:
    """The chosen token's logprob (+ its rank and the top-N when the request asked)."""
    logprobs = {token: token_logprob}
    rank = None
    if num_logprobs is not None:
        rank = int((row_logprobs > row_logprobs[token]).sum()) + 1
        if num_logprobs > 0:
            top = torch.topk(row_logprobs, num_logprobs)
            for value, top_token in zip(top.values.tolist(), top.indices.tolist()):
                logprobs.setdefault(top_token, value)
    return SequenceOutput(parent_seq_id, token, logprobs, rank)


def _prompt_logprobs(logits: torch.Tensor, group: SequenceGroupToSample):
    """Per prompt row: {actual next prompt token: logprob, + top-N} and that token's rank."""
    logprobs = torch.log_softmax(logits[group.prompt_logprob_indices], dim=-1)
    targets = torch.tensor(group.prompt_logprob_token_ids, device=logits.device)
    target_logprobs = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > target_logprobs).sum(dim=-1) + 1).tolist()
    num_top = group.sampling_params.prompt_logprobs
    top = torch.topk(logprobs, num_top) if num_top > 0 else None
    results = []
    for i, (target, value) in enumerate(zip(targets.tolist(), target_logprobs.squeeze(1).tolist())):
        entry = {target: value}
        if top is not None:
            for top_value, top_token in zip(top.values[i].tolist(), top.indices[i].tolist()):
                entry.setdefault(top_token, top_value)
        results.append(entry)
    return results, ranks
