"""What completions and chat share: model check, tokenization, limits, streams, logprobs.

Mirrors `vllm/entrypoints/openai/serving_engine.py`. Every check that can fail a request
runs here, BEFORE the request reaches the engine, so a bad request costs no KV blocks and
always gets a clear 4xx with OpenAI's error body.
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
# megabyte prompt being tokenized does not hold up every other request's short one.
NUM_TOKENIZER_THREADS = 4


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
        models=None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.models = models  # an `OpenAIServingModels` (the LoRA adapters' names too), or None
        # One request may carry a batch of prompts; without a cap, one client could queue
        # thousands ahead of everybody else's requests.
        self.max_prompts_per_request = max_prompts_per_request
        self.max_model_len = engine.model_config.max_model_len
        self.max_num_seqs = engine.scheduler_config.max_num_seqs
        # A private copy: the step thread detokenizes with the engine's tokenizer at the same
        # time as the server tokenizes new prompts.
        self.tokenizer = copy.deepcopy(engine.get_tokenizer())
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
    ) -> list[AsyncStream]:
        """Add one engine request per prompt; if one is refused, abort the others (-> 400)."""
        streams: list[AsyncStream] = []
        try:
            for i, (token_ids, sampling_params) in enumerate(zip(prompts_token_ids, params)):
                prompt = {"prompt_token_ids": token_ids}
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, sampling_params,
                                                             priority=priority, lora_request=lora_request))
        except BaseException as e:
            await self.engine.abort([stream.request_id for stream in streams])
            if isinstance(e, ValueError):
                raise OpenAIError.from_value_error(e) from e
            raise
        return streams

    async def abort_unfinished(self, streams: Sequence[AsyncStream]) -> None:
        await self.engine.abort([s.request_id for s in streams if not s.finished])

    async def sse_stream(
        self, request_id: str, events: AsyncIterator[str], streams: Sequence[AsyncStream]
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


async def merge_streams(streams: Sequence[AsyncStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
    streams: Sequence[AsyncStream], receive, abort
) -> list[RequestOutput | None]:
    """Wait for every request's last output; if the client hangs up first, abort them all."""

    async def last_output(stream: AsyncStream) -> RequestOutput | None:
        final = None
        async for output in stream.generator():
            final = output
        return final

    gathered = asyncio.ensure_future(asyncio.gather(*(last_output(s) for s in streams)))
    watcher = asyncio.ensure_future(wait_until_disconnected(receive))
    try:
        await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():  # the client left: free its blocks, answer nobody
            await abort([s.request_id for s in streams])
        return await gathered
    finally:
        watcher.cancel()
        # One request failed, or we were cancelled: the others must not run on unobserved.
        await abort([s.request_id for s in streams if not s.finished])
