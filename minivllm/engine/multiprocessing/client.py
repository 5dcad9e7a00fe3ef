"""`MQLLMEngineClient`: what the API server holds when the engine runs in its own process.

Mirrors `vllm/engine/multiprocessing/client.py` (v0.6). It offers the server the same calls as
`AsyncLLMEngine` (`add_request`, `generate`, `abort`, `check_health`, `get_tokenizer`, the
configs, stat loggers, LoRA adapters), so the server does not know which one it has:

    add_request ──RPCProcessRequest──> engine process ──RPCRequestAccepted / RPCError──> the caller
    abort ────────RPCAbortRequest────> (the stream ends here at once, the blocks free there)
    output loop <─RPCStepOutputs────── each step: outputs to their streams, Stats to the loggers

The output loop also reads the engine's heartbeat. If the engine process dies, it notices
within a second; if the heartbeats stop (the process is frozen) or say the engine loop hangs,
within `HEARTBEAT_TIMEOUT_S`. Either way every stream in flight ends with `MQEngineDeadError`,
`check_health` raises, and new requests are refused (the server answers 503). RPCs block their
caller: the server makes them from a worker thread, never on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import tempfile
import threading
import time
from typing import Any

import zmq
import zmq.asyncio

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm_engine import AsyncStream, EngineStepError
from minivllm.engine.metrics import StatLoggerBase
from minivllm.engine.multiprocessing import (IPC_HEARTBEAT_EXT, IPC_INPUT_EXT, IPC_OUTPUT_EXT, IPC_RPC_EXT,
                                             POLLING_TIMEOUT_MS, MQEngineDeadError, RPCAbortRequest, RPCError,
                                             RPCHeartbeat, RPCProcessRequest, RPCRequestAccepted,
                                             RPCShutdownRequest, RPCStartupRequest, RPCStepFailed, RPCStepOutputs,
                                             RPCUtilityRequest, remove_ipc_dir)
from minivllm.engine.multiprocessing.deltas import OutputDeltaDecoder
from minivllm.engine.multiprocessing.engine import run_mp_engine
from minivllm.engine.protocol import EngineClient
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Start-up loads the model (and on a GPU profiles memory, captures CUDA graphs): be patient.
STARTUP_TIMEOUT_S = 900.0
# How long an RPC between steps (a LoRA adapter's load) may wait for the engine.
RPC_TIMEOUT_S = 120.0
# How long `shutdown` lets the engine process exit on its own before terminating it.
SHUTDOWN_TIMEOUT_S = 30.0
# No heartbeat for this long (the engine process sends one every HEARTBEAT_INTERVAL_S, from a
# thread that a long step does not hold up): the process is frozen, and declared dead.
HEARTBEAT_TIMEOUT_S = 5.0


class MergingAsyncStream(AsyncStream):
    """A stream whose caller, if it falls behind (outputs queued up while it was busy, e.g. a
    server writing hundreds of streams), gets the queued outputs as one, and catches up in
    one chunk instead of one per step (vLLM v1's `RequestOutputCollector` merges the same
    way): cumulative outputs by keeping the newest (it says everything the skipped ones said),
    DELTA outputs by appending them (`RequestOutput.add`). A caller that keeps up still sees
    every step. (`AsyncLLMEngine` does not merge: its step thread and its callers share one
    GIL and take turns anyway, and its tests check that every step arrives.)"""

    def __init__(self, request_id: str, on_cancel, delta: bool = False) -> None:
        super().__init__(request_id, on_cancel)
        self.delta = delta

    def _next_item(self):
        item = self._items.popleft()
        while isinstance(item, RequestOutput) and self._items and isinstance(self._items[0], RequestOutput):
            newer = self._items.popleft()
            if self.delta:
                item.add(newer)
            else:
                item = newer
        return item


class MQLLMEngineClient(EngineClient):
    """Talks to an engine process started by `from_engine_args`.

    Example:
        >>> client = MQLLMEngineClient.from_engine_args(EngineArgs())      # doctest: +SKIP
        >>> async for output in client.generate("ROMEO:", SamplingParams(max_tokens=8), "r0"):
        ...     print(output.outputs[0].text)                              # grows token by token
        >>> client.shutdown()
    """

    def __init__(self, ipc_path: str, process: multiprocessing.Process) -> None:
        self.ipc_path = ipc_path
        self.process = process
        self.ctx = zmq.Context()
        self.input_socket = self._connect(self.ctx, zmq.PUSH, IPC_INPUT_EXT)
        self.rpc_socket = self._connect(self.ctx, zmq.REQ, IPC_RPC_EXT)
        self._rpc_lock = threading.Lock()  # one RPC at a time on the REQ socket
        self.stat_loggers: dict[str, StatLoggerBase] = {}
        # Keyed by wire id: the caller's request id plus a number, unique for this client's life,
        # so that a late output of an aborted request never reaches a new one reusing its id.
        self.streams: dict[str, AsyncStream] = {}
        self._wire_ids: dict[str, str] = {}  # the caller's request id -> its wire id
        self._next_wire_number = itertools.count()
        self._accepting: dict[str, asyncio.Future] = {}
        self.decoder = OutputDeltaDecoder()  # outputs arrive as deltas (deltas.py)
        self._loop_task: asyncio.Task | None = None
        self._output_socket: zmq.asyncio.Socket | None = None
        self._heartbeat_socket: zmq.asyncio.Socket | None = None
        self._last_heartbeat = time.monotonic()
        self._dead: str | None = None  # why the engine is unusable, once it is
        try:
            self.engine_config = self._rpc(RPCStartupRequest(), STARTUP_TIMEOUT_S)
        except BaseException:
            self.ctx.destroy(linger=0)  # never left to the GC (see `_close_output_socket`)
            raise
        self.model_config = self.engine_config.model_config
        self.scheduler_config = self.engine_config.scheduler_config
        self.tokenizer = None if self.model_config.skip_tokenizer_init else self.model_config.load_tokenizer()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "MQLLMEngineClient":
        """Start the engine process and wait until its engine is built."""
        engine_args.create_engine_config()  # bad arguments raise ValueError here, before any process
        ipc_path = "ipc://" + tempfile.mkdtemp(prefix="minivllm-mq-") + "/engine"
        # spawn, not fork: a forked child would inherit this process's CUDA state and threads.
        process = multiprocessing.get_context("spawn").Process(
            target=run_mp_engine, args=(engine_args, ipc_path), name="MQLLMEngine")
        process.start()
        try:
            return cls(ipc_path, process)
        except BaseException:
            _stop_process(process)
            remove_ipc_dir(ipc_path)
            raise

    def _connect(self, ctx: zmq.Context, kind: int, suffix: str, conflate: bool = False) -> zmq.Socket:
        socket = ctx.socket(kind)
        if conflate:
            socket.setsockopt(zmq.CONFLATE, 1)  # only the newest message waits to be read
        else:
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.ipc_path + suffix)
        return socket

    # ------------------------------------------------------------------ RPCs
    def _rpc(self, request, timeout_s: float = RPC_TIMEOUT_S):
        """Send one RPC and wait for its answer, checking every second that the engine lives."""
        with self._rpc_lock:
            self._check_alive()
            self.rpc_socket.send_pyobj(request)
            deadline = time.monotonic() + timeout_s
            while not self.rpc_socket.poll(POLLING_TIMEOUT_MS):
                self._check_alive()
                if time.monotonic() > deadline:
                    # A REQ socket that sent and got no answer accepts no new request: replace it.
                    self.rpc_socket.close()
                    self.rpc_socket = self._connect(self.ctx, zmq.REQ, IPC_RPC_EXT)
                    raise TimeoutError(f"the engine process did not answer {type(request).__name__} "
                                       f"within {timeout_s:.0f} s")
            response = self.rpc_socket.recv_pyobj()
        if response.exception is not None:
            raise response.exception
        return response.result

    def _check_alive(self) -> None:
        if self._dead is None and not self.process.is_alive():
            self._dead = f"the engine process exited (exit code {self.process.exitcode}); its log says why"
        if self._dead is not None:
            raise MQEngineDeadError(self._dead)

    def add_lora(self, lora_request) -> bool:
        return self._rpc(RPCUtilityRequest("add_lora", (lora_request,)))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._rpc(RPCUtilityRequest("remove_lora", (lora_int_id,)))

    # ------------------------------------------------------------- the output loop
    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def start_background_loop(self) -> None:
        """Start reading outputs on the running event loop (done lazily by the first request)."""
        if self.is_running:
            return
        self._close_output_socket()
        # An asyncio socket belongs to one event loop: a new one for each loop that serves.
        self.actx = zmq.asyncio.Context()
        self._output_socket = self._connect(self.actx, zmq.PULL, IPC_OUTPUT_EXT)
        self._heartbeat_socket = self._connect(self.actx, zmq.PULL, IPC_HEARTBEAT_EXT, conflate=True)
        self._loop_task = asyncio.get_running_loop().create_task(self._run_output_loop())

    async def stop_background_loop(self) -> None:
        """Abort every request in flight (their callers get `EngineStepError`, as from
        `AsyncLLMEngine`) and stop reading outputs."""
        if self.is_running:
            aborted = list(self.streams)
            self._fail_everything(EngineStepError("the engine loop was stopped."))
            if aborted and self._dead is None:
                self.input_socket.send_pyobj(RPCAbortRequest(aborted))
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._close_output_socket()  # (the loop's `finally` did, unless it never started)

    def _close_output_socket(self) -> None:
        """Close the output socket and its context now. Left to the garbage collector, a
        context and its socket die in one cycle: the weak reference by which the context finds
        its sockets is cleared first, so its `__del__` waits in `term()` for a socket still
        open, and the whole process hangs in a GC pass (seen in the test suite)."""
        if self._output_socket is not None:
            self._output_socket.close(linger=0)
            self._heartbeat_socket.close(linger=0)
            self.actx.destroy(linger=0)
            self._output_socket = self._heartbeat_socket = None

    async def _run_output_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._output_socket, zmq.POLLIN)
        poller.register(self._heartbeat_socket, zmq.POLLIN)
        self._last_heartbeat = time.monotonic()  # the engine's heartbeats are read from now on
        try:
            while True:
                events = dict(await poller.poll(POLLING_TIMEOUT_MS))
                if self._output_socket in events:
                    # Everything that has arrived, then let the streams' readers run: a reader
                    # that keeps up sees every step; behind a backlog (this process is the
                    # bottleneck) its stream merges the queued outputs into one (AsyncStream).
                    while await self._output_socket.poll(0):
                        self._handle_frames(await self._output_socket.recv_multipart())
                    await asyncio.sleep(0)
                self._check_alive()
                # After the outputs, whose handling may take a while: never a stale verdict.
                await self._check_heartbeat()
        except MQEngineDeadError as e:
            logger.error("%s", e)
            in_flight = list(self.streams)
            self._fail_everything(e)
            if in_flight and self.process.is_alive():  # a frozen engine that resumes drops them
                self.input_socket.send_pyobj(RPCAbortRequest(in_flight))
        except Exception as e:  # never die silently: every caller would wait forever
            logger.exception("the engine client's output loop failed")
            self._dead = f"the engine client's output loop failed: {e!r}"
            self._fail_everything(MQEngineDeadError(self._dead))
        finally:  # in the loop's own thread, however the loop ends (cancelled, a dead engine)
            self._close_output_socket()

    async def _check_heartbeat(self) -> None:
        """Read the newest heartbeat, if one came (CONFLATE keeps only it); raise
        `MQEngineDeadError` if it reports a hung loop or none came for `HEARTBEAT_TIMEOUT_S`."""
        if await self._heartbeat_socket.poll(0):
            heartbeat = await self._heartbeat_socket.recv_pyobj()
            self._last_heartbeat = time.monotonic()
            if isinstance(heartbeat, RPCHeartbeat) and heartbeat.error is not None and self._dead is None:
                self._dead = heartbeat.error
        silent_s = time.monotonic() - self._last_heartbeat
        if self._dead is None and silent_s > HEARTBEAT_TIMEOUT_S:
            self._dead = f"the engine process sent no heartbeat for {silent_s:.0f} s: it is frozen or hung"
        if self._dead is not None:
            raise MQEngineDeadError(self._dead)

    def _handle_frames(self, frames: list[bytes]) -> None:
        """Handle one message from the engine; one that cannot be read is logged and dropped
        (the loop, and every stream with it, goes on)."""
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames, not 1")
            message = pickle.loads(frames[0])
        except Exception:
            logger.exception("dropped an unreadable message from the engine process")
            return
        self._handle(message)

    def _handle(self, message) -> None:
        if isinstance(message, RPCStepOutputs):
            for wire in message.outputs:
                self._deliver(wire)
            for stats in message.stats:
                for stat_logger in self.stat_loggers.values():
                    stat_logger.log(stats)
        elif isinstance(message, RPCRequestAccepted):
            self._settle(message.request_id, None)
        elif isinstance(message, RPCError):
            self._end_stream(message.request_id)
            self._settle(message.request_id, message.exception)
        elif isinstance(message, RPCStepFailed):
            for request_id in message.request_ids:
                self._end_stream(request_id, EngineStepError(message.message))

    def _deliver(self, wire) -> None:
        wire_id = wire[0]
        stream = self.streams.get(wire_id)
        if stream is None:  # aborted here while the engine ran its step
            self.decoder.forget(wire_id)
            return
        output = self.decoder.decode(wire)
        output.request_id = stream.request_id  # the caller's id, not the wire's
        stream.put(output)
        if output.finished:
            self._end_stream(wire_id)

    def _settle(self, request_id: str, exception: BaseException | None) -> None:
        future = self._accepting.pop(request_id, None)
        if future is None or future.done():
            return
        if exception is None:
            future.set_result(None)
        else:
            future.set_exception(exception)

    def _end_stream(self, wire_id: str, exception: BaseException | None = None) -> None:
        self.decoder.forget(wire_id)
        stream = self.streams.pop(wire_id, None)
        if stream is not None:
            self._wire_ids.pop(stream.request_id, None)
            stream.finish(exception)

    def _fail_everything(self, error: BaseException) -> None:
        for request_id in list(self.streams):
            self._end_stream(request_id, error)
        for request_id in list(self._accepting):
            self._settle(request_id, error)

    # ------------------------------------------------------------ public API
    async def add_request(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0,
                          lora_request: Any = None) -> AsyncStream:
        """Send a request and wait until the engine has accepted it (its errors raise here)."""
        self._check_alive()
        self.start_background_loop()
        if request_id in self._wire_ids:
            raise ValueError(f"request {request_id!r} already exists.")
        wire_id = f"{request_id}#{next(self._next_wire_number)}"
        # A stream whose reader falls behind (a busy server) gets what queued up as one output.
        delta = params.output_kind == RequestOutputKind.DELTA
        stream = MergingAsyncStream(request_id, on_cancel=self._abort_now, delta=delta)
        if delta:
            self.decoder.add_delta_request(wire_id)
        accepted = asyncio.get_running_loop().create_future()
        self._wire_ids[request_id] = wire_id
        self.streams[wire_id], self._accepting[wire_id] = stream, accepted
        self.input_socket.send_pyobj(RPCProcessRequest(
            wire_id, prompt, params, time.monotonic() if arrival_time is None else arrival_time,
            priority, lora_request))
        try:
            await accepted
        except asyncio.CancelledError:
            self._abort_now(request_id)
            raise
        return stream

    def _abort_now(self, request_id: str) -> None:
        wire_id = self._wire_ids.get(request_id)
        if wire_id is None:
            return  # finished or aborted already
        self._end_stream(wire_id)
        # A caller still waiting for the engine to accept it hears that it was aborted.
        self._settle(wire_id, EngineStepError(f"request {request_id!r} was aborted."))
        if self._dead is None:
            self.input_socket.send_pyobj(RPCAbortRequest([wire_id]))

    def get_tokenizer(self):
        return self.tokenizer

    def add_logger(self, logger_name: str, stat_logger: StatLoggerBase) -> None:
        if logger_name in self.stat_loggers:
            raise KeyError(f"a logger named {logger_name!r} already exists.")
        self.stat_loggers[logger_name] = stat_logger

    def remove_logger(self, logger_name: str) -> None:
        del self.stat_loggers[logger_name]

    async def check_health(self) -> None:
        """Raise RuntimeError (the server answers 503) if the engine process is gone."""
        try:
            self._check_alive()
        except MQEngineDeadError as e:
            raise RuntimeError(str(e)) from None

    def shutdown(self) -> None:
        """Stop the engine process (politely, then by force) and release the sockets."""
        if self._dead is None and self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.input_socket.send_pyobj(RPCShutdownRequest(), zmq.NOBLOCK)
            _stop_process(self.process)
        else:  # exited, or frozen or hung: it would not answer
            _stop_process(self.process, timeout_s=0)
        self._dead = self._dead or "the engine was shut down"
        task = self._loop_task
        if task is not None and not task.done() and task.get_loop().is_running():
            # Still reading (no stop_background_loop first), maybe in another thread: its loop
            # cancels it, and the loop's `finally` closes the output socket there.
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                task.get_loop().call_soon_threadsafe(task.cancel)
        else:
            self._close_output_socket()
        self.ctx.destroy(linger=0)
        remove_ipc_dir(self.ipc_path)


def _stop_process(process: multiprocessing.Process, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    process.join(timeout_s)
    if process.is_alive() and timeout_s > 0:
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
