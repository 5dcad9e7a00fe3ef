"""What the engine hands back to the user: `RequestOutput`, `CompletionOutput`, `Logprob`.

Mirrors `vllm/outputs.py` (v0, ~0.6) with the same field names, so code written against
vLLM's `LLM.generate` reads minivllm's outputs unchanged:

    for output in llm.generate(prompts, params):
        print(output.prompt, "->", output.outputs[0].text, output.outputs[0].finish_reason)

Plain data, no torch: a notebook can build and print these without a model.
`RequestOutput.from_seq_group` turns the engine's `SequenceGroup` into one (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.sampling_params import RequestOutputKind, SamplingParams

# Logprob lives in sequence.py, as in vLLM; outputs re-export it.
from minivllm.sequence import Logprob, RequestMetrics, Sequence, SequenceGroup, SequenceStatus

# Finished before a stop condition or a length: `finish_message` says why.
_EARLY_ENDINGS = (SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_IGNORED)
# One entry per position: {token_id: Logprob} holding the chosen token and the top-N.
SampleLogprobs = list[dict[int, "Logprob"]]
# The first prompt token has no logprob (nothing precedes it), hence the None.
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with `n=2` has two).

    Attributes:
        index: position of this completion among the request's outputs.
        text: the generated text (stop strings removed unless `include_stop_str_in_output`).
        token_ids: the generated token ids.
        cumulative_logprob: sum of the chosen tokens' logprobs (None unless requested or beam).
        logprobs: per generated token, the top-N alternatives (None unless `logprobs` was set).
        finish_reason: None while running, else "stop", "length" or "abort" (ended early: see
            `finish_message`).
        stop_reason: the stop string or stop token id that ended it (None for EOS or length).
        finish_message: why the engine ended it early ("abort": a prompt that can never fit,
            lack of swap space, a failure inside a step), None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None

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
        num_cached_tokens: prompt tokens whose KV was reused, not computed: prefix-cache hits
            plus tokens a KV connector loaded (vLLM's field; None before admission).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int | None = None

    def add(self, next_output: "RequestOutput") -> None:
        """Merge the request's next DELTA output into this one, in place: each completion's new
        text, token ids and logprobs appended, the newest state kept (vLLM v1's `add`). A
        stream whose reader fell behind hands it one output instead of several."""
        by_index = {c.index: c for c in self.outputs}
        for new in next_output.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob, old.finish_reason = new.cumulative_logprob, new.finish_reason
            old.stop_reason, old.finish_message = new.stop_reason, new.finish_message
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        self.finished, self.metrics = next_output.finished, next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens

    @classmethod
    def from_seq_group(
        cls,
        seq_group: SequenceGroup,
        decode_token: Callable[[int], str] | None = None,
        eos_token_id: int | None = None,
    ) -> "RequestOutput":
        """The request's state now: text and tokens of its `n` reported sequences, all of them
        (CUMULATIVE, FINAL_ONLY) or those no output has returned yet (DELTA).

        Args:
            decode_token: token id -> its text, for `Logprob.decoded_token` (None: not filled).
            eos_token_id: the model's EOS (beam scores do not count a final EOS in the length).
        """
        params = seq_group.sampling_params
        seqs = _reported_seqs(seq_group, eos_token_id)
        want_logprobs = params.logprobs is not None
        delta = params.output_kind == RequestOutputKind.DELTA
        buffer_length = _stop_string_buffer(params)
        first_tokens = delta and seqs[0].last_output_token_ids_offset == 0  # before this output
        outputs = []
        for index, seq in enumerate(seqs):
            returned = seq.last_output_token_ids_offset if delta else 0
            token_ids = seq.get_output_token_ids_to_return(delta)
            outputs.append(CompletionOutput(
                index=index,
                text=seq.get_output_text_to_return(buffer_length, delta),
                token_ids=token_ids,
                cumulative_logprob=seq.get_cumulative_logprob() if want_logprobs or params.use_beam_search else None,
                logprobs=_sample_logprobs(seq, decode_token, returned) if want_logprobs else None,
                finish_reason=SequenceStatus.get_finished_reason(seq.status),
                stop_reason=seq.stop_reason,
                finish_message=seq_group.finish_message if seq.status in _EARLY_ENDINGS else None,
            ))
        # A delta carries the prompt's logprobs once, with the request's first tokens (as vLLM).
        with_prompt_logprobs = not delta or (first_tokens and bool(outputs[0].token_ids or seq_group.is_finished()))
        return cls(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt,
            prompt_token_ids=seq_group.prompt_token_ids,
            prompt_logprobs=_prompt_logprobs(seq_group, decode_token) if with_prompt_logprobs else None,
            outputs=outputs,
            finished=seq_group.is_finished(),
            metrics=seq_group.metrics,
            num_cached_tokens=seq_group.num_cached_tokens,
        )


def _stop_string_buffer(params: SamplingParams) -> int:
    """Characters a running sequence holds back: the longest stop string could still be
    completing in them, and then they are cut (vLLM's buffer_length)."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def _reported_seqs(seq_group: SequenceGroup, eos_token_id: int | None) -> list[Sequence]:
    """All sequences in creation order when n == best_of (indices stay put while streaming);
    else the best n: by beam score for beam search, by cumulative logprob for best_of."""
    params = seq_group.sampling_params
    seqs = seq_group.get_seqs()
    if params.best_of == params.n and not params.use_beam_search:
        return seqs
    if params.use_beam_search:
        def score(seq: Sequence) -> float:
            return seq.get_beam_search_score(params.length_penalty, eos_token_id=eos_token_id)
    else:
        def score(seq: Sequence) -> float:
            return seq.get_cumulative_logprob()
    return sorted(seqs, key=score, reverse=True)[: params.n]


def _sample_logprobs(seq: Sequence, decode_token, start: int = 0) -> SampleLogprobs:
    """Per output token from `start` on: {token: Logprob}."""
    return [
        _logprob_dict(entry, token, rank, decode_token)
        for entry, token, rank in zip(seq.output_logprobs[start:], seq.get_output_token_ids()[start:],
                                      seq.output_ranks[start:])
    ]


def _prompt_logprobs(seq_group: SequenceGroup, decode_token) -> PromptLogprobs | None:
    if seq_group.prompt_logprobs is None:
        return None
    tokens = seq_group.prompt_token_ids
    return [
        None if entry is None else _logprob_dict(entry, tokens[i], seq_group.prompt_ranks[i], decode_token)
        for i, entry in enumerate(seq_group.prompt_logprobs)
    ]


def _logprob_dict(entry: dict[int, float], chosen: int, chosen_rank: int | None, decode_token) -> dict[int, Logprob]:
    """{token: Logprob}, the chosen token first. The others are the top-N, so their rank is
    their place in descending logprob order; the chosen token's rank came from the sampler."""
    by_logprob = sorted(entry, key=lambda t: entry[t], reverse=True)
    ranks = {token: place + 1 for place, token in enumerate(by_logprob)}
    ranks[chosen] = chosen_rank

    def text(token: int) -> str | None:
        return decode_token(token) if decode_token is not None else None

    result = {chosen: Logprob(entry[chosen], ranks[chosen], text(chosen))}
    for token in by_logprob:
        if token != chosen:
            result[token] = Logprob(entry[token], ranks[token], text(token))
    return result

