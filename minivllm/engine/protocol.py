"""`EngineClient`: what the API server needs from an engine, wherever the engine runs.

Mirrors `vllm/engine/protocol.py`. Two implementations: `AsyncLLMEngine` (the engine in the
server's process, `async_llm_engine.py`) and `MQLLMEngineClient` (the engine in its own
process, `multiprocessing/client.py`). Each provides `add_request` (queue a request, return its
`AsyncStream` once the engine accepted it) and `_abort_now` (end one request's stream and have
the engine drop it); streaming and aborting many are the same on top of those two.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from typing import Any

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class EngineClient(ABC):
    @abstractmethod
    async def add_request(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0, lora_request: Any = None):
        """Queue a request and wait until the engine has accepted it; its `AsyncStream`.
        Raises what the engine's `add_request` raises (e.g. `ValueError`), in this caller only."""

    @abstractmethod
    def _abort_now(self, request_id: str) -> None:
        """End the request's stream now; the engine frees its blocks before its next step."""

    async def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's `RequestOutput` after every step that advanced it.

        As `LLMEngine.step`: by default each output holds everything so far; with
        `output_kind=RequestOutputKind.DELTA` only what is new (what a streaming server asks).
        Leaving the loop early (break, cancellation, a dropped client) aborts the request.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, priority=priority)
        # aclosing: if our caller stops early, the stream's generator is closed right away,
        # and its `finally` aborts the request (no waiting for the garbage collector).
        async with contextlib.aclosing(stream.generator()) as outputs:
            async for output in outputs:
                yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests: their streams end now, the engine frees their blocks before its next step."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in request_ids:
            self._abort_now(rid)
