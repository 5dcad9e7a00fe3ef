"""Request outputs on the wire as deltas: only what the other side does not have yet.

A `RequestOutput` is cumulative: every step repeats the prompt's token ids and all the text,
token ids and logprobs generated so far, so pickling it costs time in the request's length,
for every request, every model step. So the engine process sends each request's prompt once,
and then, per completion, only the new text, token ids and logprobs; the client appends them
to the output it rebuilt last time and hands
the server the same cumulative `RequestOutput` it would get from an engine in its process.
(vLLM v1 goes further: the engine core sends new token ids only and detokenizes in the front.)

When a completion does not simply grow (beam search may swap a beam's tokens; a stop string
trims the text), its full value is sent instead, so the rebuilt output is always exact.

A request that asked for `RequestOutputKind.DELTA` outputs (the OpenAI server's streams) gets
them as they are: the engine built only the new part, and there is nothing to diff or rebuild
(comparing a cumulative output with the last one would cost time in its length, every step).
"""

from __future__ import annotations

from typing import Any

from minivllm.outputs import CompletionOutput, RequestOutput

# One completion on the wire: (extends_previous, index, text, token_ids, cumulative_logprob,
# logprobs, finish_reason, stop_reason, finish_message); text/token_ids/logprobs are the new
# part if extends_previous, else the whole value.
WireCompletion = tuple
# One request: (request_id, (prompt, prompt_token_ids) the first time else None,
# prompt_logprobs when new else None, [WireCompletion], finished, metrics, num_cached_tokens).
WireOutput = tuple


class OutputDeltaEncoder:
    """Engine side: remembers, per live request, what the client already has."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[Any, list[CompletionOutput]]] = {}  # id -> (prompt_logprobs, outputs)
        # Requests whose outputs are deltas already -> whether the client has their prompt.
        self._delta_ids: dict[str, bool] = {}

    def add_delta_request(self, request_id: str) -> None:
        """The request's outputs are `RequestOutputKind.DELTA`: send them as they are."""
        self._delta_ids[request_id] = False

    def encode(self, output: RequestOutput) -> WireOutput:
        if output.request_id in self._delta_ids:
            return self._encode_delta(output)
        previous = self._sent.get(output.request_id)
        head = (output.prompt, output.prompt_token_ids) if previous is None else None
        prompt_logprobs = output.prompt_logprobs
        if previous is not None and _same_length(prompt_logprobs, previous[0]):
            prompt_logprobs = None  # the client has them
        sent_outputs = previous[1] if previous is not None else []
        completions = [_encode_completion(c, sent_outputs[i] if i < len(sent_outputs) else None)
                       for i, c in enumerate(output.outputs)]
        if output.finished:
            self._sent.pop(output.request_id, None)
        else:  # (from_seq_group builds fresh lists each step: keeping references is safe)
            self._sent[output.request_id] = (output.prompt_logprobs, output.outputs)
        return (output.request_id, head, prompt_logprobs, completions, output.finished, output.metrics,
                output.num_cached_tokens)

    def _encode_delta(self, output: RequestOutput) -> WireOutput:
        first = not self._delta_ids[output.request_id]
        if output.finished:
            del self._delta_ids[output.request_id]
        else:
            self._delta_ids[output.request_id] = True
        head = (output.prompt, output.prompt_token_ids) if first else None
        completions = [_encode_completion(c, None) for c in output.outputs]  # each one whole: it is the delta
        return (output.request_id, head, output.prompt_logprobs, completions, output.finished, output.metrics,
                output.num_cached_tokens)

    def forget(self, request_ids) -> None:
        """Aborted requests: the client drops them too."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)
            self._delta_ids.pop(request_id, None)


class OutputDeltaDecoder:
    """Client side: rebuilds each request's cumulative `RequestOutput` from the deltas."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}
        self._delta_ids: set[str] = set()

    def add_delta_request(self, request_id: str) -> None:
        """The request's outputs are deltas: nothing to rebuild, and the prompt's logprobs come
        once, as from an engine in this process."""
        self._delta_ids.add(request_id)

    def decode(self, wire: WireOutput) -> RequestOutput:
        request_id, head, prompt_logprobs, completions, finished, metrics, num_cached_tokens = wire
        last = self._last.get(request_id)
        prompt, prompt_token_ids = head if head is not None else (last.prompt, last.prompt_token_ids)
        if request_id in self._delta_ids:
            outputs = [_decode_completion(c, None) for c in completions]
            output = RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
                                   metrics, num_cached_tokens)
            self._remember(request_id, output, finished)
            return output
        if prompt_logprobs is None and last is not None:
            prompt_logprobs = last.prompt_logprobs
        previous = last.outputs if last is not None else []
        outputs = [_decode_completion(c, previous[i] if i < len(previous) else None) for i, c in enumerate(completions)]
        output = RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
                               metrics, num_cached_tokens)
        self._remember(request_id, output, finished)
        return output

    def _remember(self, request_id: str, output: RequestOutput, finished: bool) -> None:
        if finished:
            self.forget(request_id)
        else:
            self._last[request_id] = output

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)
        self._delta_ids.discard(request_id)


def _same_length(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b)


def _encode_completion(c: CompletionOutput, sent: CompletionOutput | None) -> WireCompletion:
    grows = (sent is not None and sent.index == c.index and c.text.startswith(sent.text)
             and c.token_ids[:len(sent.token_ids)] == sent.token_ids
             and (sent.logprobs is None) == (c.logprobs is None))
    if grows:
        text, token_ids = c.text[len(sent.text):], c.token_ids[len(sent.token_ids):]
        logprobs = None if c.logprobs is None else c.logprobs[len(sent.logprobs):]
    else:
        text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
    return (grows, c.index, text, token_ids, c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason,
            c.finish_message)


def _decode_completion(wire: WireCompletion, previous: CompletionOutput | None) -> CompletionOutput:
    grows, index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason, finish_message = wire
    if grows:
        text, token_ids = previous.text + text, previous.token_ids + token_ids
        logprobs = None if logprobs is None else previous.logprobs + logprobs
    return CompletionOutput(index, text, list(token_ids), cumulative_logprob, logprobs, finish_reason, stop_reason,
                            finish_message)
