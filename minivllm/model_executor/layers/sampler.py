"""From logits to the next token of every sequence: `Sampler`.

Mirrors `vllm/model_executor/layers/sampler.py` (v0). A request takes, on its row of the
`[num_selected, vocab]` logits, the steps in vLLM v0's order:

    0. logits processors  `SamplingParams.logits_processors`, each row's own (vLLM's hook)
    1. min_tokens       stop tokens (EOS, `stop_token_ids`) get -inf until enough tokens exist
    2. penalties        repetition (prompt + output), frequency and presence (output only)
    3. temperature      z = logits / T (greedy rows: T = 1)
    4. top-k, top-p     keep the k largest, then the smallest set with probability >= p
    5. min-p            drop tokens less likely than min_p x the most likely one
    6. choose           greedy arg-max | random: arg-max(z + noise(seed, position, token id))

Steps 1-6 run on the logits' device for the whole batch (`DeviceSampler`, one host sync);
3-6 are one `SampleTokens` call, whose spec is `kernels/reference.py`. Logprobs are those of
the distribution after steps 0-5; prompt logprobs are the model's raw distribution. Beam
search, `best_of` fan-outs and seeded `n > 1` take `parallel_sampling` instead.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from minivllm.model_executor.layers.device_sampler import DeviceSampler
from minivllm.model_executor.layers.parallel_sampling import is_parallel, sample_parallel
from minivllm.model_executor.sampling_metadata import SamplingMetadata, SequenceGroupToSample, sampled_seq_ids
from minivllm.sequence import SamplerOutput, SequenceGroupOutput


class Sampler(nn.Module):
    """Turn selected logits rows into one `SequenceGroupOutput` per scheduled request.

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
                model runner; other float dtypes are upcast where processed).
        Returns:
            one `SequenceGroupOutput` per entry of `sampling_metadata.seq_groups`.
        """
        groups = sampling_metadata.seq_groups
        outputs = [SequenceGroupOutput(samples=[]) for _ in groups]
        for group, output in zip(groups, outputs):
            if group.prompt_logprob_indices:
                output.prompt_logprobs, output.prompt_ranks = _prompt_logprobs(logits.float(), group)
        logits = apply_logits_processors(logits, groups)
        plain, parallel = [], []
        for group, output in zip(groups, outputs):
            if group.do_sample:
                (parallel if is_parallel(group) else plain).append((group, output))
        if plain:
            self._sample(logits, *zip(*plain))
        if parallel:
            sample_parallel(self.device_sampler, logits, *map(list, zip(*parallel)))
        return SamplerOutput(outputs)

    def _sample(self, logits: torch.Tensor, groups: tuple, outputs: tuple) -> None:
        """Steps 1-6 for one row per sequence, then the step's one copy back to the host."""
        rows = [row for group in groups for row in group.sample_indices]
        sample_logits = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tensors = self.device_sampler.prepare(list(groups), logits.shape[-1], logits.device)
        drawn = self.device_sampler(sample_logits, tensors).to_host()
        for output, samples in zip(outputs, drawn.sequence_outputs(list(groups), tensors)):
            output.samples = samples


def apply_logits_processors(logits: torch.Tensor, groups: list[SequenceGroupToSample]) -> torch.Tensor:
    """Each sample row through its request's processors, in order: `f(output_ids, logits)` or
    `f(prompt_ids, output_ids, logits)` (vLLM's two forms, told apart by their arity). Returns
    the logits untouched when no request has processors, else an fp32 copy."""
    if not any(g.do_sample and g.sampling_params.logits_processors for g in groups):
        return logits
    logits = logits.to(torch.float32, copy=True)
    for group in groups:
        for row, seq_id in zip(group.sample_indices, sampled_seq_ids(group)):
            data = group.seq_data[seq_id]
            for processor in group.sampling_params.logits_processors:
                if _num_positional(processor) == 3:
                    logits[row] = processor(list(data.prompt_token_ids), list(data.output_token_ids), logits[row])
                else:
                    logits[row] = processor(list(data.output_token_ids), logits[row])
    return logits


def _num_positional(function) -> int:
    parameters = inspect.signature(function).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


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
