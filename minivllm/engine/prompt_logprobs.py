"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the sampler's rows gathered per request.

Mirrors the prompt-logprob half of `vllm/engine/output_processor/single_step.py` (v0).
`seq_group.prompt_logprobs[t]` is token t's `{token_id: logprob}`, None for token 0 and for
positions a prefix-cache hit skipped (they had no logits).
"""

from __future__ import annotations

from minivllm.sequence import SequenceGroup, SequenceGroupOutput


def record_prompt_logprobs(seq_group: SequenceGroup, output: SequenceGroupOutput, first_computed: int) -> None:
    """Store this chunk's prompt logprobs once (a recompute after preemption repeats them)."""
    if seq_group.prompt_logprobs is None:
        seq_group.prompt_logprobs, seq_group.prompt_ranks = [None], [None]
    ranks = output.prompt_ranks or [None] * len(output.prompt_logprobs)
    for offset, (entry, rank) in enumerate(zip(output.prompt_logprobs, ranks)):
        position = first_computed + 1 + offset  # row t predicts prompt token t + 1
        while len(seq_group.prompt_logprobs) < position:
            seq_group.prompt_logprobs.append(None)
            seq_group.prompt_ranks.append(None)
        if len(seq_group.prompt_logprobs) == position:
            seq_group.prompt_logprobs.append(entry)
            seq_group.prompt_ranks.append(rank)
