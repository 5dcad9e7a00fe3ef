"""What the engine hands back to the user: `RequestOutput`, `CompletionOutput`, `Logprob`.

Mirrors `vllm/outputs.py` (v0, ~0.6) with the same field names, so code written against
vLLM's `LLM.generate` reads minivllm's outputs unchanged:

    for output in llm.generate(prompts, params):
        print(output.prompt, "->", output.outputs[0].text, output.outputs[0].finish_reason)

Plain data, no torch: a notebook can build and print these without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sequence import RequestMetrics

# One entry per position: {token_id: Logprob} holding the chosen token and the top-N.
SampleLogprobs = list[dict[int, "Logprob"]]
# The first prompt token has no logprob (nothing precedes it), hence the None.
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the distribution the token was sampled from.
        rank: 1 for the most likely token, 2 for the next, ... (None when unknown).
        decoded_token: the token's text, when the request detokenizes.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with `n=2` has two).

    Attributes:
        index: position of this completion among the request's outputs.
        text: the generated text (stop strings removed unless `include_stop_str_in_output`).
        token_ids: the generated token ids.
        cumulative_logprob: sum of the chosen tokens' logprobs (None unless requested or beam).
        logprobs: per generated token, the top-N alternatives (None unless `logprobs` was set).
        finish_reason: None while running, else "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything the engine knows about one request after a step.

    Attributes:
        request_id: the id given to `add_request`.
        prompt: the prompt text (None if the request gave token ids).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token (first is None), when `prompt_logprobs` was set.
        outputs: the `n` completions, best first.
        finished: True once every sequence of the request has finished.
        metrics: arrival, first-scheduled, first-token and finish times.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
