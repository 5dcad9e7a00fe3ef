"""`MQLLMEngine`: an `LLMEngine` in its own process, fed and drained over ZeroMQ sockets.

Mirrors `vllm/engine/multiprocessing/engine.py` (v0.6). The loop is `AsyncLLMEngine`'s,
without asyncio: between two steps, take every queued add and abort from the input socket and
answer RPCs; step while there is work; send each step's outputs (and a multi-step run's partial
outputs as they come, so streams stay token by token) with the step's `Stats`. With nothing to
do it sleeps in `poll`, waking every second. A thread of its own sends the heartbeat and
watches the API server's process: once that is gone, the loop ends after its current step
(and the process exits anyway if that step does not return). A frame on a socket that is not
one of ours is logged and dropped.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time

import zmq

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import StatLoggerBase, Stats
from minivllm.engine.multiprocessing import (HEARTBEAT_INTERVAL_S, IPC_HEARTBEAT_EXT, IPC_INPUT_EXT, IPC_OUTPUT_EXT,
                                             IPC_RPC_EXT, POLLING_TIMEOUT_MS, RPCAbortRequest, RPCError,
                                             RPCHeartbeat, RPCProcessRequest, RPCRequestAccepted, RPCResponse,
                                             RPCShutdownRequest, RPCStartupRequest, RPCStepFailed, RPCStepOutputs,
                                             RPCUtilityRequest, remove_ipc_dir)
from minivllm.engine.multiprocessing.deltas import OutputDeltaEncoder
from minivllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

# How long a message waits for a client to read the output socket before it is dropped.
_READER_WAIT_S = 2.0
# The LLMEngine methods a client may call between steps.
_UTILITY_METHODS = ("add_lora", "remove_lora")
# A loop that has not come round for this long is hung (a step that never returns): the
# heartbeat says so. Far above any step's time: the loop comes round at least every second.
LOOP_STALL_TIMEOUT_S = 60.0
# Once the API server's process is gone, how long the current step may take before this
# process exits without finishing it.
_ORPHAN_GRACE_S = 5.0


class _StatsCollector(StatLoggerBase):
    """Keeps each step's `Stats`, to be sent with the step's outputs (the client logs them)."""

    def __init__(self) -> None:
        self.pending: list[Stats] = []

    def log(self, stats: Stats) -> None:
        self.pending.append(stats)


class MQLLMEngine:
    """Serves one `LLMEngine` to one `MQLLMEngineClient` over three sockets at `ipc_path`."""

    def __init__(self, engine: LLMEngine, ipc_path: str, loop_stall_timeout_s: float = LOOP_STALL_TIMEOUT_S) -> None:
        self.engine = engine
        self.ipc_path = ipc_path
        self.stats = _StatsCollector()
        engine.add_logger("mq_client", self.stats)
        self.ctx = zmq.Context()
        self.input_socket = self._bind(zmq.PULL, ipc_path + IPC_INPUT_EXT)
        self.output_socket = self._bind(zmq.PUSH, ipc_path + IPC_OUTPUT_EXT)
        self.rpc_socket = self._bind(zmq.REP, ipc_path + IPC_RPC_EXT)
        # Only the newest heartbeat waits for the reader (CONFLATE): a late reader sees a fresh one.
        self.heartbeat_socket = self._bind(zmq.PUSH, ipc_path + IPC_HEARTBEAT_EXT, conflate=True)
        self.request_ids: set[str] = set()  # requests the engine holds now
        self.encoder = OutputDeltaEncoder()  # outputs leave as deltas (deltas.py says why)
        self.running = True
        self.loop_stall_timeout_s = loop_stall_timeout_s
        self.last_loop_time = time.monotonic()  # when the loop last came round
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="MQLLMEngine-heartbeat",
                                                  daemon=True)
        self._heartbeat_thread.start()

    def _bind(self, kind: int, address: str, conflate: bool = False) -> zmq.Socket:
        socket = self.ctx.socket(kind)
        if conflate:
            socket.setsockopt(zmq.CONFLATE, 1)
        else:
            socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a slow reader queues outputs, loses none
            socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        return socket

    # ------------------------------------------------------------- the heartbeat
    def _heartbeat_loop(self) -> None:
        """In a thread of its own (the heartbeat socket is used nowhere else): every
        `HEARTBEAT_INTERVAL_S`, tell the client the process lives and whether the loop still
        comes round; once the API server's process is gone, end the loop, then the process."""
        orphaned_at = None
        while not self._stop_heartbeat.wait(HEARTBEAT_INTERVAL_S):
            if not _parent_alive():
                if orphaned_at is None:
                    logger.warning("the API server's process is gone: the engine process exits")
                    orphaned_at = time.monotonic()
                    self.running = False  # the loop leaves after its current step
                elif time.monotonic() - orphaned_at > _ORPHAN_GRACE_S:
                    logger.error("the engine loop did not end within %.0f s: exiting without it", _ORPHAN_GRACE_S)
                    remove_ipc_dir(self.ipc_path)
                    os._exit(1)
                continue
            stalled_s = time.monotonic() - self.last_loop_time
            error = None
            if stalled_s > self.loop_stall_timeout_s:
                error = f"the engine loop has not come round for {stalled_s:.0f} s (a step hangs)"
            with contextlib.suppress(zmq.Again):  # no reader yet: nobody is waiting for it
                self.heartbeat_socket.send_pyobj(RPCHeartbeat(error), zmq.NOBLOCK)

    # ------------------------------------------------------------------ the loop
    def run_engine_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(self.rpc_socket, zmq.POLLIN)
        while self.running:
            self.last_loop_time = time.monotonic()
            busy = self.engine.has_unfinished_requests()
            events = dict(poller.poll(0 if busy else POLLING_TIMEOUT_MS))
            if self.rpc_socket in events:
                self._handle_rpc(self._recv(self.rpc_socket))
            aborted = self._handle_inputs() if self.input_socket in events else False
            # After aborts, step even with nothing left: its stats then show the freed blocks.
            if self.engine.has_unfinished_requests() or aborted:
                self._step()

    def _handle_inputs(self) -> bool:
        """Apply every queued add and abort; True if an abort reached a request the engine held."""
        aborted = False
        while self.running:
            try:
                message = self._recv(self.input_socket, zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                aborted |= self._apply(message)
            except Exception:  # a message of the right type with wrong contents
                logger.exception("dropped a message the engine could not apply: %s", type(message).__name__)
        return aborted

    def _apply(self, message) -> bool:
        """Apply one input message; True if it aborted a request the engine held."""
        if isinstance(message, RPCProcessRequest):
            self._add_request(message)
        elif isinstance(message, RPCAbortRequest):
            live = [rid for rid in message.request_ids if rid in self.request_ids]
            self.request_ids.difference_update(live)
            if live:
                self.engine.abort_request(live)
                self.encoder.forget(live)
                return True
        elif isinstance(message, RPCShutdownRequest):
            self.running = False
        elif message is not None:
            logger.warning("dropped an unknown message on the input socket: %s", type(message).__name__)
        return False

    def _recv(self, socket: zmq.Socket, flags: int = 0):
        """One message, or None for a frame that is not one of ours (logged and dropped: a stray
        writer on a socket must not end the engine). The sockets' folder is private to this user."""
        frames = socket.recv_multipart(flags)
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames, not 1")
            return pickle.loads(frames[0])
        except Exception as e:
            logger.warning("dropped a malformed message (%d bytes): %r", sum(len(f) for f in frames), e)
            return None

    def _add_request(self, request: RPCProcessRequest) -> None:
        if not isinstance(request.request_id, str):  # the client could not route an answer to it
            raise ValueError(f"request id {request.request_id!r} is not a string")
        try:
            self.engine.add_request(request.request_id, request.prompt, request.params,
                                    arrival_time=request.arrival_time, priority=request.priority,
                                    lora_request=request.lora_request)
        except Exception as e:  # a bad request: only its caller hears about it
            self._send(RPCError(request.request_id, e))
            return
        self.request_ids.add(request.request_id)
        if request.params.output_kind == RequestOutputKind.DELTA:
            self.encoder.add_delta_request(request.request_id)
        self._send(RPCRequestAccepted(request.request_id))

    def _handle_rpc(self, request) -> None:
        """Answer one RPC (the REP socket needs exactly one answer per request)."""
        if isinstance(request, RPCStartupRequest):
            response = RPCResponse(result=self.engine.engine_config)
        elif isinstance(request, RPCUtilityRequest) and request.method in _UTILITY_METHODS:
            try:
                response = RPCResponse(result=getattr(self.engine, request.method)(*request.args))
            except Exception as e:
                response = RPCResponse(exception=e)
        else:
            name = "a malformed message" if request is None else type(request).__name__
            response = RPCResponse(exception=ValueError(f"unknown RPC: {name}"))
        self.rpc_socket.send_pyobj(response)

    def _step(self) -> None:
        try:
            outputs = self.engine.step(self._send_partial)
        except Exception as e:
            # As AsyncLLMEngine: the failed step may have touched any request the engine holds.
            logger.exception("engine step failed; aborting the requests it was running")
            failed, self.request_ids = sorted(self.request_ids), set()
            self.engine.abort_request(failed)
            self.encoder.forget(failed)
            self._send(RPCStepFailed(failed, f"engine step failed: {e!r}"))
            return
        self._send_outputs(outputs)

    def _send_partial(self, outputs) -> None:
        self._send(RPCStepOutputs([self.encoder.encode(output) for output in outputs]))

    def _send_outputs(self, outputs) -> None:
        for output in outputs:
            if output.finished:
                self.request_ids.discard(output.request_id)
        stats, self.stats.pending = self.stats.pending, []
        self._send(RPCStepOutputs([self.encoder.encode(output) for output in outputs], stats))

    def _send(self, message) -> None:
        """Send, unless no client reads: a PUSH socket without a peer would block for ever
        (between two serving loops of the client, or after the server died). A reader that is
        just connecting gets `_READER_WAIT_S`; then the message is dropped (nobody waits for it)."""
        deadline = time.monotonic() + _READER_WAIT_S
        while not self.output_socket.poll(50, zmq.POLLOUT):
            if time.monotonic() > deadline or not _parent_alive():
                logger.debug("no client reads the outputs: dropped %s", type(message).__name__)
                return
        self.output_socket.send_pyobj(message)

    def close(self) -> None:
        self._stop_heartbeat.set()
        self._heartbeat_thread.join()
        self.engine.shutdown()
        self.ctx.destroy(linger=0)
        # The server may not have: uvicorn re-raises SIGTERM once it has shut down, which ends
        # the server's process before its own clean-up (we then leave on the parent check).
        remove_ipc_dir(self.ipc_path)


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def run_mp_engine(engine_args: EngineArgs, ipc_path: str) -> None:
    """The engine process's entry point: build the engine, serve it until told to stop."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (the client's last resort, or a process manager) ends the loop like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Ctrl-C in the terminal reaches the whole process group: the API server shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = MQLLMEngine(LLMEngine.from_engine_args(engine_args), ipc_path)
    gc.collect()
    gc.freeze()  # the engine lives as long as this process: keep its objects out of every GC scan
    try:
        engine.run_engine_loop()
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
