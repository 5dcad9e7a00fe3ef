"""From logits to the next token of every sequence: `Sampler`.

Mirrors `vllm/model_executor/layers/sampler.py` (v0). On its rows of the `[num_selected,
vocab_size]` logits, a request takes vLLM v0's steps in order:

    0. logits processors  each request's own functions (`logits_processor.py`)
    1. min_tokens         stop tokens (EOS, `stop_token_ids`) get -inf until enough tokens exist
    2. penalties          repetition (prompt + output), frequency and presence (output only)
    3. temperature        z = logits / T (greedy rows: T = 1)
    4. top-k, top-p       keep the k largest, then the smallest set with probability >= p
    5. min-p              drop tokens less likely than min_p x the most likely one
    6. choose             greedy arg-max | random: arg-max(z + noise(seed, position, token id))

Steps 1-6 run on the logits' device for the whole batch (`DeviceSampler`, one copy back). Logprobs
are those after steps 0-5, prompt logprobs the model's raw ones (`logprobs.py`). Beam search,
`best_of` fan-outs and seeded `n > 1` go to `parallel_sampling`.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.model_executor.layers.device_sampler import DeviceSampler
from minivllm.model_executor.layers.logits_processor import apply_logits_processors
from minivllm.model_executor.layers.logprobs import prompt_logprobs
from minivllm.model_executor.layers.parallel_sampling import is_parallel, sample_parallel
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sequence import SamplerOutput, SequenceGroupOutput


class Sampler(nn.Module):
    """backend: "torch" or "triton", the kernels' backend (the model attention's setting)."""

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self.device_sampler = DeviceSampler(backend)

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """logits: `[num_selected, vocab_size]` (fp32 from the model runner), rows as in
        `sampling_metadata`. Returns one `SequenceGroupOutput` per group, in its order."""
        groups = sampling_metadata.seq_groups
        outputs = [SequenceGroupOutput(samples=[]) for _ in groups]
        for group, output in zip(groups, outputs):
            if group.prompt_logprob_indices:
                output.prompt_logprobs, output.prompt_ranks = prompt_logprobs(logits, group)
        logits = apply_logits_processors(logits, groups)
        plain, parallel = [], []
        for group, output in zip(groups, outputs):
            if group.do_sample:
                (parallel if is_parallel(group) else plain).append((group, output))
        if plain:
            self._sample(logits, *map(list, zip(*plain)))
        if parallel:
            sample_parallel(self.device_sampler, logits, *map(list, zip(*parallel)))
        return SamplerOutput(outputs)

    def _sample(self, logits: torch.Tensor, groups: list, outputs: list) -> None:
        """Steps 1-6 for one row per sequence, then the step's one copy back to the host."""
        rows = [row for group in groups for row in group.sample_indices]
        sample_logits = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tensors = self.device_sampler.prepare(groups, logits.shape[-1], logits.device)
        drawn = self.device_sampler(sample_logits, tensors).to_host()
        for output, samples in zip(outputs, drawn.sequence_outputs(groups, tensors)):
            output.samples = samples
