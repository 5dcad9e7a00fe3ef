"""What completions and chat share: model check, tokenization, limits, streams, logprobs.

Mirrors `vllm/entrypoints/openai/serving_engine.py`. Every check that can fail a request
runs here, BEFORE the request reaches the engine, so a bad request costs no KV blocks and
always gets a clear 4xx with OpenAI's error body. A request's prompts reach the engine at
most `max_seqs_in_flight` sequences at a time (`StagedStream`), so one huge request shares
the steps with those that arrive after it (vLLM adds them all at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.async_llm_engine import AsyncStream
from minivllm.engine.multiprocessing import MQEngineDeadError
from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingRequestMixin
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# vLLM's default cap on returned alternatives per token (`max_logprobs`); OpenAI allows 20.
MAX_LOGPROBS = 20
# JSON has no -inf; like vLLM, report an impossible token with a very negative number.
_MIN_REPORTED_LOGPROB = -9999.0
# Threads that tokenize prompts (each with its own tokenizer copy). More than one, so that a
# long prompt being tokenized does not hold up every other request's short one.
NUM_TOKENIZER_THREADS = 4
# A text prompt longer than this many characters per context token is first tokenized only
# that far: if the part already overflows the context, the rest is never read (a megabyte of
# text costs the tokenizer seconds and hundreds of MiB). Without a vocabulary to bound a
# token's length, 16 characters (about four times English text's average).
DEFAULT_MAX_CHARS_PER_TOKEN = 16
# Tokens a cut through the middle of a word may add to the part tokenized (it ends in pieces).
_CUT_WORD_TOKENS = 32
# By default one request's sequences in the engine at once are at most max_num_seqs / this: its
# other prompts wait here and join the engine's queue as its earlier ones finish, behind
# whatever arrived meanwhile, and a step always has room for a request that arrives later.
IN_FLIGHT_SHARE = 4


class OpenAIError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI's error fields."""

    def __init__(
        self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.code = message, status_code, param, code

    @classmethod
    def from_value_error(cls, error: ValueError) -> "OpenAIError":
        """A 400 for a value the request may not have, naming the field when the error does."""
        return cls(str(error), param=getattr(error, "param", None))

    def to_response(self) -> ErrorResponse:
        if self.status_code >= 500:
            error_type = "server_error"
        else:
            error_type = "not_found_error" if self.status_code == 404 else "invalid_request_error"
        return ErrorResponse(error=ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.code))


def internal_error(request_id: str) -> OpenAIError:
    """What a client hears about a failure on our side: no exception text, no paths."""
    return OpenAIError(f"Internal server error (request id {request_id}); the details are in the server log.", 500)


def sse_event(payload: Any) -> str:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """The parts of request handling that do not depend on the endpoint."""

    def __init__(
        self, engine: EngineClient, served_model_names: list[str], max_prompts_per_request: int = 64,
        models=None, max_seqs_per_request: int = 256, max_seqs_in_flight: int | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.models = models  # an `OpenAIServingModels` (the LoRA adapters' names too), or None
        # One request may carry a batch of prompts, each with n (best_of) sequences; without a
        # cap, one client could queue thousands ahead of everybody else's requests.
        self.max_prompts_per_request = max_prompts_per_request
        self.max_seqs_per_request = max_seqs_per_request
        self.max_model_len = engine.model_config.max_model_len
        self.max_num_seqs = engine.scheduler_config.max_num_seqs
        self.max_seqs_in_flight = max_seqs_in_flight or max(1, self.max_num_seqs // IN_FLIGHT_SHARE)
        # A private copy: the step thread detokenizes with the engine's tokenizer at the same
        # time as the server tokenizes new prompts.
        self.tokenizer = copy.deepcopy(engine.get_tokenizer())
        self.max_prompt_chars = self.max_model_len * max_chars_per_token(self.tokenizer)
        # Tokenizing a long prompt takes a while (seconds for megabytes of text); in a pool of
        # threads it never stalls the event loop, which streams everybody else's tokens, nor
        # the other prompts. Each thread gets its own copy: a fast tokenizer is not meant to be
        # shared between threads.
        self._tokenizer_threads = ThreadPoolExecutor(NUM_TOKENIZER_THREADS, thread_name_prefix="minivllm-tokenize")
        self._thread_tokenizers = threading.local()

    # ------------------------------------------------------------ validation
    def check_model(self, model: str | None):
        """An unknown model is a 404, as in vLLM (None: a route where `model` is optional).
        Returns the LoRA adapter the name picks, or None for the base model."""
        if self.models is not None:
            return self.models.lora_request_for(model)
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.run_in_tokenizer_thread("encode", text, add_special_tokens=add_special_tokens)

    async def encode_prompt(self, text: str, add_special_tokens: bool) -> list[int]:
        """`encode`, but a text far longer than the context is refused from its beginning alone."""
        if len(text) > self.max_prompt_chars:
            head = await self.encode(text[:self.max_prompt_chars], add_special_tokens)
            if len(head) > self.max_model_len + _CUT_WORD_TOKENS:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                    f"prompt's first {self.max_prompt_chars} of its {len(text)} characters already hold "
                    f"{len(head)} tokens. Please reduce the length of the prompt.",
                    param="prompt", code="context_length_exceeded")
        return await self.encode(text, add_special_tokens)

    async def run_in_tokenizer_thread(self, method: str, *args, **kwargs):
        """`tokenizer.<method>(*args, **kwargs)` on a tokenizer thread's own copy."""
        call = functools.partial(self._call_thread_tokenizer, method, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads, call)

    def _call_thread_tokenizer(self, method: str, *args, **kwargs):
        tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._thread_tokenizers.tokenizer = copy.deepcopy(self.tokenizer)
        return getattr(tokenizer, method)(*args, **kwargs)

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        # An id outside the embedding table would fail inside a step, taking the batch with it.
        vocab_size = self.engine.model_config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"token ids must be in [0, {vocab_size}), got {bad[:5]}.", param=param)

    def build_sampling_params(self, request: SamplingRequestMixin, num_prompt_tokens: int) -> SamplingParams:
        """Check the request against the model's limits and map it to `SamplingParams`."""
        try:
            request.check_supported()
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from e
        if num_prompt_tokens == 0:
            raise OpenAIError("The prompt is empty.", param="prompt")
        self._check_context_length(num_prompt_tokens, request.requested_max_tokens)
        self._check_fan_out(request)
        try:
            # Default max_tokens: whatever still fits in the context after the prompt.
            return request.to_sampling_params(default_max_tokens=self.max_model_len - num_prompt_tokens)
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from e

    def _check_context_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        requested = num_prompt_tokens + max(max_tokens or 1, 1)
        if requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested - num_prompt_tokens} for the completion). Please reduce the length "
                "of the prompt or of the completion.",
                param="max_tokens" if max_tokens else "prompt",
                code="context_length_exceeded",
            )

    def check_num_seqs(self, request: SamplingRequestMixin, num_prompts: int) -> None:
        """Prompts x best_of (or n) sequences: at most `max_seqs_per_request` (-> 400)."""
        per_prompt = max(request.n, request.best_of or 0)
        total = num_prompts * per_prompt
        if total > self.max_seqs_per_request:
            raise OpenAIError(
                f"This request asks for {num_prompts} prompt(s) x {per_prompt} sequences = {total} sequences; "
                f"the server allows at most {self.max_seqs_per_request} per request (--max-seqs-per-request).",
                param="best_of" if per_prompt > request.n else "n")

    def _check_fan_out(self, request: SamplingRequestMixin) -> None:
        # A request with more sequences than a step can hold could never be scheduled.
        for name in ("n", "best_of"):
            value = getattr(request, name)
            if value is not None and value > self.max_num_seqs:
                raise OpenAIError(f"{name} must be at most {self.max_num_seqs} (max_num_seqs), got {value}.", param=name)
        logprobs = request.requested_logprobs
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise OpenAIError(f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}.", param="logprobs")

    # --------------------------------------------------------------- engine
    async def add_requests(
        self, request_id: str, prompts_token_ids: list[list[int]], params: list[SamplingParams], priority: int,
        lora_request=None,
    ) -> list[StagedStream]:
        """One engine request per prompt, `max_seqs_in_flight` sequences at a time: the first
        ones are added now (one refused: the others are aborted, -> 400), each later one when
        its turn comes, as its stream is read."""
        slots = InFlightSlots(self.max_seqs_in_flight)

        def adder(i: int, token_ids: list[int], sampling_params: SamplingParams):
            return functools.partial(self.engine.add_request, f"{request_id}-{i}", {"prompt_token_ids": token_ids},
                                     sampling_params, priority=priority, lora_request=lora_request)

        streams = [StagedStream(f"{request_id}-{i}", adder(i, ids, p), self.engine.abort, slots,
                                max(p.n, p.best_of or 0)) for i, (ids, p) in enumerate(zip(prompts_token_ids, params))]
        try:
            for stream in streams:
                if not await stream.start_if_free():
                    break
        except BaseException as e:
            await self.engine.abort([stream.request_id for stream in streams if stream.started])
            if isinstance(e, ValueError):
                raise OpenAIError.from_value_error(e) from e
            raise
        return streams

    async def abort_unfinished(self, streams: Sequence[StagedStream]) -> None:
        for stream in streams:
            stream.close()  # one not started yet never will be
        await self.engine.abort([s.request_id for s in streams if s.started and not s.finished])

    async def sse_stream(
        self, request_id: str, events: AsyncIterator[str], streams: Sequence[StagedStream]
    ) -> AsyncIterator[str]:
        """What every Server-Sent-Events response shares around its own `events`.

        An error mid-stream is reported in-band (the 200 headers are already sent, like vLLM),
        as a generic message with the request id: the details go to the server log only.
        Whatever the client left unfinished is aborted, so a hang-up frees its blocks; the
        stream ends with `data: [DONE]`.
        """
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except MQEngineDeadError as e:  # not a bug here: the client may hear what happened
            yield sse_event(OpenAIError(str(e), 503).to_response())
        except Exception:
            logger.exception("request %s failed while streaming", request_id)
            yield sse_event(internal_error(request_id).to_response())
        finally:
            # The client hung up (this generator was cancelled or closed): free the blocks.
            await self.abort_unfinished(streams)
        yield SSE_DONE

    # ------------------------------------------------------------- logprobs
    def decoded(self, token_id: int, logprob: Logprob) -> str:
        if logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])


class InFlightSlots:
    """A budget of sequences in the engine, for one HTTP request's prompts (a counting
    semaphore whose units are sequences). A prompt wider than the whole budget runs alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._changed = asyncio.Condition()

    def try_take(self, num_seqs: int) -> bool:
        if self.used and self.used + num_seqs > self.capacity:
            return False
        self.used += num_seqs
        return True

    async def take(self, num_seqs: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.try_take(num_seqs))

    async def give_back(self, num_seqs: int) -> None:
        self.used -= num_seqs
        async with self._changed:
            self._changed.notify_all()


class StagedStream:
    """One prompt's engine request, added when the request's `InFlightSlots` has room; reads
    like the `AsyncStream` it wraps (`request_id`, `finished`, `generator()`).

    `close()` (the client left) stops one not yet added from ever being added.
    """

    def __init__(self, request_id: str, add, abort, slots: InFlightSlots, num_seqs: int) -> None:
        self.request_id, self._add, self._abort = request_id, add, abort
        self._slots, self._num_seqs = slots, num_seqs
        self._stream: AsyncStream | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        return self._stream is not None

    @property
    def finished(self) -> bool:
        return self._stream is not None and self._stream.finished

    def close(self) -> None:
        self._closed = True

    async def start_if_free(self) -> bool:
        """Add the request now if the slots have room; False if not."""
        if not self._slots.try_take(self._num_seqs):
            return False
        try:
            self._stream = await self._add()
        except BaseException:
            await self._slots.give_back(self._num_seqs)
            raise
        return True

    async def generator(self) -> AsyncIterator[RequestOutput]:
        if self._stream is None:
            await self._slots.take(self._num_seqs)
            if self._closed:
                await self._slots.give_back(self._num_seqs)
                return
            try:
                self._stream = await self._add()
            except BaseException:
                await self._slots.give_back(self._num_seqs)
                raise
            if self._closed:  # the client left while it was being added
                await self._abort([self.request_id])
        try:
            async for output in self._stream.generator():
                yield output
        finally:
            # Shielded: a cancelled reader must still hand its sequences to the next prompt.
            await asyncio.shield(self._slots.give_back(self._num_seqs))


@dataclass
class Delta:
    """What one streamed choice has not sent yet."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    first: bool  # the choice's first chunk


@dataclass
class DeltaTracker:
    """Per-choice chunks for a stream, from the engine's DELTA outputs (what a stream asks the
    engine for): skips outputs with nothing new, counts the tokens each choice has sent.

    Example: outputs "To", " be", "," for choice 0 give chunks "To", " be", ",".
    """

    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    num_generated: int = 0  # tokens of the finished choices, for the usage chunk

    def delta(self, index: int, output: CompletionOutput) -> Delta | None:
        """Choice `index`'s new part, or None if it has nothing new (or already finished)."""
        if index in self.finished:
            return None
        if not output.text and not output.token_ids and output.finish_reason is None:
            return None
        first = index not in self.sent_tokens
        self.sent_tokens[index] = self.sent_tokens.get(index, 0) + len(output.token_ids)
        if output.finish_reason is not None:
            self.finished.add(index)
            self.num_generated += self.sent_tokens[index]
        return Delta(output.text, output.token_ids, output.logprobs or [], first)


def wire_stop_reason(output: CompletionOutput) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or token id; for a request the engine ended early
    (finish_reason "abort": it could never fit, or failed inside a step), why. OpenAI clients
    read finish_reason; `stop_reason` is vLLM's extra field, so the detail goes there."""
    return output.stop_reason if output.finish_message is None else output.finish_message


def reported_logprob(logprob: float) -> float:
    return max(logprob, _MIN_REPORTED_LOGPROB)


def top_entries(step_logprobs: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely alternatives at one position, most likely first."""
    ranked = sorted(step_logprobs.items(), key=lambda item: -item[1].logprob)
    return ranked[:num]


async def merge_streams(streams: Sequence[StagedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive: yields (stream index, output)."""
    if len(streams) == 1:  # the common case needs no tasks
        async for output in streams[0].generator():
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def drain(index: int, stream: AsyncStream) -> None:
        try:
            async for output in stream.generator():
                await queue.put((index, output))
        except Exception as e:  # handed to the consumer, raised there
            await queue.put((index, e))
        await queue.put((index, finished))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def wait_until_disconnected(receive) -> None:
    """Return when the HTTP client hangs up (the ASGI `http.disconnect` message)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_final_outputs(
    streams: Sequence[StagedStream], receive, abort
) -> list[RequestOutput | None]:
    """Wait for every request's last output; if the client hangs up first, abort them all."""

    async def last_output(stream: StagedStream) -> RequestOutput | None:
        final = None
        async for output in stream.generator():
            final = output
        return final

    gathered = asyncio.ensure_future(asyncio.gather(*(last_output(s) for s in streams)))
    watcher = asyncio.ensure_future(wait_until_disconnected(receive))
    try:
        await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():  # the client left: free its blocks, answer nobody
            for stream in streams:
                stream.close()
            await abort([s.request_id for s in streams if s.started])
        return await gathered
    finally:
        watcher.cancel()
        # One request failed, or we were cancelled: the others must not run on unobserved.
        for stream in streams:
            stream.close()
        await abort([s.request_id for s in streams if s.started and not s.finished])


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry),
    or DEFAULT_MAX_CHARS_PER_TOKEN when the vocabulary does not say."""
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return DEFAULT_MAX_CHARS_PER_TOKEN
    return max(longest, 1)
