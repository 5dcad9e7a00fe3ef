"""`SamplingParams.logits_processors`, each request's own functions over its logits rows.

Mirrors `_apply_logits_processors` of `vllm/model_executor/layers/logits_processor.py` (v0),
with its two forms, told apart by their arity: `f(output_ids, logits_row)` and
`f(prompt_ids, output_ids, logits_row)`, each returning the new row.
"""

from __future__ import annotations

import inspect

import torch

from minivllm.model_executor.sampling_metadata import SequenceGroupToSample, sampled_seq_ids


def apply_logits_processors(logits: torch.Tensor,
                            groups: list[SequenceGroupToSample]) -> torch.Tensor:
    """Each sample row through its request's processors, in order. Returns the logits untouched
    when no request has processors, else an fp32 copy."""
    if not any(g.do_sample and g.sampling_params.logits_processors for g in groups):
        return logits
    logits = logits.to(torch.float32, copy=True)
    for group in groups:
        for row, seq_id in zip(group.sample_indices, sampled_seq_ids(group)):
            data = group.seq_data[seq_id]
            for processor in group.sampling_params.logits_processors:
                output_ids = list(data.output_token_ids)
                if _num_positional(processor) == 3:
                    logits[row] = processor(list(data.prompt_token_ids), output_ids, logits[row])
                else:
                    logits[row] = processor(output_ids, logits[row])
    return logits


def _num_positional(function) -> int:
    parameters = inspect.signature(function).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
