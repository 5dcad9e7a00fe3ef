"""What proposers hand the scorer, and the distribution a request samples from.

`sampling_probs` is the plain `Sampler`'s distribution for the requests that speculate
(greedy, or random without a seed, with no penalties, logprobs or pending min_tokens:
`DeviceSampler.depends_on_logits_alone`): temperature, then the kept set of
`kernels/reference.py`'s `kept_mask` (top-k, top-p, min-p), the spec `SampleTokens` draws from.
Greedy rows become one-hot at the arg-max, so the rejection sampler treats greedy decoding as
sampling from a distribution with one certain token.

`expand_batch` lays out the target's scoring pass and the draft's catch-up as decode rows
(batch expansion, vLLM's `spec_decode/batch_expansion.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.kernels.reference import kept_mask
from minivllm.sampling_params import SamplingParams, SamplingType


@dataclass
class Proposals:
    """The proposer's guesses for the speculating sequences, in batch order.

    Attributes:
        token_ids: `[num_seqs][k]` token ids on the host, where the scorer lays out its rows
            (entries past `num_proposed` are padding).
        num_proposed: how many of each row's k tokens are real (the n-gram proposer may find
            fewer, or none).
        probs: `[num_seqs, k, vocab]` fp32 on the device, the distribution each token was drawn
            from (a draft model sampling), or None when the proposals are deterministic (n-gram
            lookup) or every request is greedy (then the rule needs the target's arg-max alone).
    """

    token_ids: list[list[int]]
    num_proposed: list[int]
    probs: torch.Tensor | None


def all_greedy(params: list[SamplingParams]) -> bool:
    """Every request decodes greedily: a guess is then accepted iff it is the target's arg-max,
    so neither the draft's nor the target's distribution is needed."""
    return all(p.sampling_type == SamplingType.GREEDY for p in params)


def expand_batch(tokens: list[list[int]], first_positions: list[int],
                 block_tables: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """Batch expansion: token j of sequence i becomes a decode row of its own at position
    `first_positions[i] + j`, over sequence i's block table -> (input_ids, positions,
    block_tables), one entry per row. A row's seq_len is its position + 1, so it attends to
    the sequence's rows before it (every row writes its K/V before any row attends).

    >>> expand_batch([[5, 6, 7], [9]], [9, 20], [[7], [3, 5]])
    ([5, 6, 7, 9], [9, 10, 11, 20], [[7], [7], [7], [3, 5]])
    """
    if not len(tokens) == len(first_positions) == len(block_tables):
        raise ValueError("tokens, first_positions and block_tables need one entry per sequence.")
    input_ids, positions, tables = [], [], []
    for seq_tokens, first, table in zip(tokens, first_positions, block_tables):
        input_ids += seq_tokens
        positions += range(first, first + len(seq_tokens))
        tables += [table] * len(seq_tokens)
    return input_ids, positions, tables


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[rows, vocab]` logits, one `SamplingParams` per row -> (probs, logprobs), both
    `[rows, vocab]` fp32: the distribution the plain sampler would draw row i's token from
    (one-hot at the arg-max for a greedy row), and the log-softmax of the processed logits
    (the logprob the plain sampler reports for the chosen token)."""
    logits = logits.float()
    greedy = torch.tensor([p.sampling_type == SamplingType.GREEDY for p in params], device=logits.device)
    temperatures = logits.new_tensor([1.0 if p.sampling_type == SamplingType.GREEDY else p.temperature
                                      for p in params])
    logits = logits / temperatures.unsqueeze(1)
    if any(p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        truncation = torch.tensor([[p.top_k, p.top_p, p.min_p] for p in params], dtype=torch.float64)
        top_k, top_p, min_p = truncation.to(logits.device).T
        logits = logits.masked_fill(~kept_mask(logits, top_k.long(), top_p.float(), min_p.float()), -float("inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    one_hot = torch.zeros_like(logprobs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.where(greedy.unsqueeze(1), one_hot, logprobs.exp())
    return probs, logprobs
