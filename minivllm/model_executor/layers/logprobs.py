"""The logprobs a request asks for beyond its token's own: the top-N and the chosen token's
rank (`SamplingParams.logprobs`), and its prompt's (`SamplingParams.prompt_logprobs`).

vLLM v0 computes both in `_get_logprobs` of `vllm/model_executor/layers/sampler.py`. The top-N
are those of the distribution the token was drawn from (after min_tokens, penalties,
temperature and truncation); prompt logprobs are the model's raw distribution.
"""

from __future__ import annotations

import torch

from minivllm.kernels import reference
from minivllm.model_executor.sampling_metadata import SamplingTensors, SequenceGroupToSample


def top_logprobs(logits: torch.Tensor, t: SamplingTensors, tokens: torch.Tensor,
                 logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ranks `[rows]` of the drawn tokens, and the `max_logprobs` most likely tokens `[rows,
    max_logprobs]` and their logprobs (z over the kept set; outside it -inf)."""
    z = logits.float() / torch.where(t.temperature == 0, 1.0, t.temperature).unsqueeze(1)
    chosen_z = z.gather(1, tokens.unsqueeze(1))
    ranks = (z > chosen_z).sum(dim=-1) + 1
    top_z, top_ids = torch.topk(z, t.max_logprobs, dim=-1)
    log_normalizer = chosen_z - logprobs.unsqueeze(1)  # logsumexp over the kept set
    top_logprobs = top_z - log_normalizer
    if t.needs_truncation:
        kept = reference.kept_mask(z, t.top_k, t.top_p, t.min_p).gather(1, top_ids)
        top_logprobs = top_logprobs.masked_fill(~kept, -float("inf"))
    return ranks, top_ids, top_logprobs


def prompt_logprobs(logits: torch.Tensor,
                    group: SequenceGroupToSample) -> tuple[list[dict[int, float]], list[int]]:
    """Per prompt row of `group`: {the next prompt token: its logprob, + the top-N}, and that
    token's rank."""
    logprobs = torch.log_softmax(logits[group.prompt_logprob_indices].float(), dim=-1)
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
