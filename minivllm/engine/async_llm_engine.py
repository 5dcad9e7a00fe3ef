"""`AsyncLLMEngine`: the same `LLMEngine`, driven by a background loop for many callers.

Mirrors `vllm/engine/async_llm_engine.py` (v0, ~0.6). `LLMEngine` is synchronous: somebody
must call `step()` again and again. A server has many concurrent callers, each wanting the
tokens of ONE request as they arrive. This module connects the two:

    caller A ─ generate() ─┐                          ┌─> AsyncStream A ─> caller A
    caller B ─ generate() ─┼─> RequestTracker ─> loop ┼─> AsyncStream B ─> caller B
    caller C ─ abort() ────┘   (queued adds/aborts)   │
                                    engine.step() in a worker thread

* The loop is one asyncio task. It applies queued adds and aborts BETWEEN steps, so the
  engine is only ever touched by one thing at a time and needs no locks.
* `engine.step()` runs in a single worker thread (`run_in_executor`), so the event loop keeps
  serving HTTP while the model computes. With nothing to do, the loop sleeps on an event.
* Failures stay local: a request the engine rejects raises in its caller only; a step that
  raises aborts the requests it was running, reports the error to their callers, and the
  loop carries on with the next request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.protocol import EngineClient
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Marks the end of a stream in its queue (an object no engine output can be equal to).
_STREAM_END = object()


def _no_op() -> None:
    pass


class EngineStepError(RuntimeError):
    """Raised to the callers whose requests were in a step that failed."""


class AsyncStream:
    """The outputs of one request on their way from the engine loop to one caller.

    Only the event-loop thread touches it, so a deque and an `asyncio.Event` suffice. The
    caller gets every output, one per step (`MergingAsyncStream`, the engine-process client's,
    merges when its caller falls behind).
    """

    def __init__(self, request_id: str, on_cancel) -> None:
        self.request_id = request_id
        self.finished = False
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._on_cancel = on_cancel

    def put(self, output: RequestOutput) -> None:
        if not self.finished:
            self._items.append(output)
            self._ready.set()

    def finish(self, exception: BaseException | None = None) -> None:
        """End the stream; a pending `exception` is raised to the caller after the outputs."""
        if not self.finished:
            self.finished = True
            self._items.append(_STREAM_END if exception is None else exception)
            self._ready.set()

    def _next_item(self):
        """The oldest queued item: an output, the end marker or an exception."""
        return self._items.popleft()

    async def generator(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                if not self._items:
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                item = self._next_item()
                if item is _STREAM_END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # The caller stopped listening early (a client hung up, a task was cancelled):
            # abort the request so that its KV blocks are freed.
            if not self.finished:
                self._on_cancel(self.request_id)


@dataclass
class _PendingAdd:
    """A request waiting for the loop to hand it to the engine."""

    request_id: str
    prompt: str | dict[str, Any]
    params: SamplingParams
    arrival_time: float | None
    priority: int
    stream: AsyncStream
    accepted: asyncio.Future = field(repr=False)
    lora_request: Any = None  # a LoRARequest, or None for the base model


class RequestTracker:
    """Bookkeeping between callers and the loop: live streams, queued adds and aborts."""

    def __init__(self) -> None:
        self.streams: dict[str, AsyncStream] = {}
        self._new_requests: list[_PendingAdd] = []
        self._aborted: set[str] = set()
        self.new_requests_event = asyncio.Event()

    def add_request(self, pending: _PendingAdd) -> None:
        if pending.request_id in self.streams:
            raise ValueError(f"request {pending.request_id!r} already exists.")
        self.streams[pending.request_id] = pending.stream
        self._new_requests.append(pending)
        self.new_requests_event.set()

    def abort_request(self, request_id: str, exception: BaseException | None = None) -> None:
        """End the caller's stream now; the engine drops the request before its next step."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return  # already finished or aborted: nothing to do
        stream.finish(exception)
        self._aborted.add(request_id)
        self.new_requests_event.set()

    def process_output(self, output: RequestOutput) -> None:
        stream = self.streams.get(output.request_id)
        if stream is None:
            return  # aborted while the step ran
        stream.put(output)
        if output.finished:
            del self.streams[output.request_id]
            stream.finish()

    def take_new_and_aborted(self) -> tuple[list[_PendingAdd], set[str]]:
        new, aborted = self._new_requests, self._aborted
        self._new_requests, self._aborted = [], set()
        self.new_requests_event.clear()
        return new, aborted

    def has_pending(self) -> bool:
        return bool(self._new_requests or self._aborted)


class AsyncLLMEngine(EngineClient):
    """An `LLMEngine` behind a background step loop, for asyncio callers.

    Example:
        >>> engine = AsyncLLMEngine.from_engine_args(EngineArgs())   # doctest: +SKIP
        >>> async for output in engine.generate("ROMEO:", SamplingParams(max_tokens=8), "r0"):
        ...     print(output.outputs[0].text)                        # grows token by token
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One thread, always the same one, runs every step (torch and CUDA graphs like that).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-step")
        self._tracker: RequestTracker | None = None
        self._loop_task: asyncio.Task | None = None
        self._stopping = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_engine_args(engine_args))

    # ------------------------------------------------------------- the loop
    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        """True if the loop died of something other than a clean stop (should never happen)."""
        task = self._loop_task
        return task is not None and task.done() and not task.cancelled() and task.exception() is not None

    def start_background_loop(self) -> None:
        """Start the step loop on the running event loop (done lazily by the first request)."""
        if self.is_running:
            return
        self._stopping = False
        self._tracker = RequestTracker()
        self._engine_request_ids: set[str] = set()  # requests the engine holds now
        self._loop_task = asyncio.get_running_loop().create_task(self._run_engine_loop())

    async def stop_background_loop(self) -> None:
        """Let the current step finish, abort every request, and end the loop task."""
        if not self.is_running:
            return
        self._stopping = True
        self._tracker.new_requests_event.set()
        await self._loop_task

    def shutdown(self) -> None:
        """Release the step thread (call after `stop_background_loop`)."""
        self._executor.shutdown(wait=True)

    async def _run_engine_loop(self) -> None:
        tracker = self._tracker
        try:
            while not self._stopping:
                if not tracker.has_pending() and not self.engine.has_unfinished_requests():
                    await tracker.new_requests_event.wait()
                    continue
                aborted = False
                try:
                    aborted = self._apply_new_and_aborted()
                except Exception:  # never let one bad add or abort kill the loop
                    logger.exception("applying new and aborted requests failed")
                # After aborts, step even if nothing is left: the step's stats then report the
                # freed blocks and the emptier queues (an empty step runs no model).
                if self.engine.has_unfinished_requests() or aborted:
                    await self._step()
                # Give the callers a chance to read their outputs before the next step.
                await asyncio.sleep(0)
        finally:
            # Stopped, or cancelled because its event loop is closing: no request may outlive
            # its callers. A cancelled step is still running in the worker thread; the engine
            # is ours again once the (single, first-in first-out) thread has run a no-op.
            with contextlib.suppress(RuntimeError):  # the executor was already shut down
                await asyncio.get_running_loop().run_in_executor(self._executor, _no_op)
            for request_id in list(tracker.streams):
                tracker.abort_request(request_id, EngineStepError("the engine loop was stopped."))
            self._apply_new_and_aborted()

    def _apply_new_and_aborted(self) -> bool:
        """Hand queued requests to the engine and apply queued aborts; True if any abort landed."""
        new_requests, aborted = self._tracker.take_new_and_aborted()
        for pending in new_requests:
            self._add_to_engine(pending)
        live_aborted = [rid for rid in aborted if rid in self._engine_request_ids]
        self._engine_request_ids.difference_update(live_aborted)
        if live_aborted:
            self.engine.abort_request(live_aborted)
        return bool(live_aborted)

    def _add_to_engine(self, pending: _PendingAdd) -> None:
        if pending.stream.finished:  # aborted before it reached the engine
            if not pending.accepted.done():
                pending.accepted.set_exception(EngineStepError(f"request {pending.request_id!r} was aborted."))
            return
        try:
            self.engine.add_request(
                pending.request_id,
                pending.prompt,
                pending.params,
                arrival_time=pending.arrival_time,
                priority=pending.priority,
                lora_request=pending.lora_request,
            )
        except Exception as e:  # a bad request: its caller alone hears about it
            self._tracker.streams.pop(pending.request_id, None)
            pending.stream.finished = True
            pending.accepted.set_exception(e)
            return
        self._engine_request_ids.add(pending.request_id)
        pending.accepted.set_result(pending.stream)

    async def _step(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Outputs of a multi-step run's earlier model steps reach their streams as they come.
            def deliver(partial):
                loop.call_soon_threadsafe(self._deliver, partial)

            outputs = await loop.run_in_executor(self._executor, self.engine.step, deliver)
        except Exception as e:
            # The failed step may have touched any request in the engine; requests still
            # queued in the tracker were not part of it and go on normally.
            logger.exception("engine step failed; aborting the requests it was running")
            for request_id in list(self._engine_request_ids):
                self._tracker.abort_request(request_id, EngineStepError(f"engine step failed: {e!r}"))
            return
        self._deliver(outputs)

    def _deliver(self, outputs) -> None:
        for output in outputs:
            if output.finished:
                self._engine_request_ids.discard(output.request_id)
            self._tracker.process_output(output)

    # ------------------------------------------------------------ public API
    async def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncStream:
        """Queue a request and wait until the engine has accepted it.

        Raises whatever `LLMEngine.add_request` raises (e.g. `ValueError` for an empty prompt),
        in this caller only. Returns the request's stream of outputs.
        """
        self.start_background_loop()
        loop = asyncio.get_running_loop()
        pending = _PendingAdd(
            request_id=request_id,
            prompt=prompt,
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            stream=AsyncStream(request_id, on_cancel=self._abort_now),
            accepted=loop.create_future(),
            lora_request=lora_request,
        )
        self._tracker.add_request(pending)
        try:
            return await pending.accepted
        except asyncio.CancelledError:
            self._abort_now(request_id)
            raise

    def _abort_now(self, request_id: str) -> None:
        if self._tracker is not None:
            self._tracker.abort_request(request_id)

    # ------------------------------------------------------- engine pass-through
    # What the API server asks of its engine, here or in another process (MQLLMEngineClient).
    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def scheduler_config(self):
        return self.engine.scheduler_config

    @property
    def engine_config(self):
        return self.engine.engine_config

    def add_logger(self, logger_name: str, stat_logger) -> None:
        self.engine.add_logger(logger_name, stat_logger)

    def remove_logger(self, logger_name: str) -> None:
        self.engine.remove_logger(logger_name)

    def add_lora(self, lora_request) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    async def check_health(self) -> None:
        """Raise if the loop has died (it should not: every step error is caught).

        The next request starts a fresh loop, so a dead loop shows until then (`GET /health` -> 503).
        """
        if self.errored:
            raise RuntimeError(f"the engine loop died: {self._loop_task.exception()!r}")
