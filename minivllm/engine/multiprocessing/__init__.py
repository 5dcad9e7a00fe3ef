"""The engine in its own process, behind the API server (vLLM v0.6's `vllm/engine/multiprocessing/`).

Why: with the engine inside the server's process, `engine.step()` runs in a worker thread and
the HTTP streams in the event-loop thread, and the two share one GIL. Most torch calls and every
file write of the step release the GIL; while the event loop is busy (hundreds of streams), the
step thread then waits up to `sys.getswitchinterval()` (5 ms) to get it back, at each release.
A step of a few dozen such calls stretches by tens of milliseconds (docs/benchmarks.md, "Serving":
the same workload with the engine in the server's process and in its own). Two processes share
no GIL:

    API server process                                   engine process (`run_mp_engine`)
    MQLLMEngineClient ─ input (PUSH) ─ RPCProcessRequest ─> MQLLMEngine ─> LLMEngine.step()
                      <─ output (PULL) ─ RPCStepOutputs ──┘   (the same loop as AsyncLLMEngine's)
                      ─ rpc (REQ/REP) ─ start-up, LoRA adapters
                      <─ heartbeat (PUSH) ─ RPCHeartbeat ── a thread of the engine process

The heartbeat (vLLM's engine health check) comes from a thread of its own every
`HEARTBEAT_INTERVAL_S`: a long step does not delay it, a frozen process sends none, and a
loop that stops coming round (a step that hangs) is reported in it. The client declares the
engine dead when the heartbeats stop or report a hung loop (`client.HEARTBEAT_TIMEOUT_S`).

The messages are pickled Python objects over ZeroMQ `ipc://` sockets, as in vLLM; outputs
travel as deltas (`deltas.py`). Detokenizing stays in the engine process, as in vLLM v0.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.async_llm_engine import EngineStepError

# The three sockets' addresses: the ipc path + one suffix each (vLLM: IPC_INPUT_EXT, ...).
IPC_INPUT_EXT = "_input_socket"
IPC_OUTPUT_EXT = "_output_socket"
IPC_RPC_EXT = "_rpc_socket"
IPC_HEARTBEAT_EXT = "_heartbeat_socket"
# How often a waiting side checks that the other process is still alive.
POLLING_TIMEOUT_MS = 1000
# How often the engine process says it is alive.
HEARTBEAT_INTERVAL_S = 0.5


def remove_ipc_dir(ipc_path: str) -> None:
    """Delete the folder of the sockets' files (both sides call it: whoever exits last wins)."""
    shutil.rmtree(ipc_path.removeprefix("ipc://").rsplit("/", 1)[0], ignore_errors=True)


class MQEngineDeadError(EngineStepError):
    """The engine process is gone or unresponsive (frozen, its loop hung): every request in flight
    fails with this, and so does every new one (the server answers 503)."""


# ------------------------------------------------------------- client -> engine
@dataclass
class RPCProcessRequest:
    """Add a request (the arguments of `LLMEngine.add_request`)."""

    request_id: str
    prompt: Any
    params: Any
    arrival_time: float
    priority: int = 0
    lora_request: Any = None


@dataclass
class RPCAbortRequest:
    request_ids: list[str]


@dataclass
class RPCStartupRequest:
    """The client's first call: answered once the engine is built, with its configuration."""


@dataclass
class RPCUtilityRequest:
    """Call `LLMEngine.<method>(*args)` between two steps (add_lora, remove_lora)."""

    method: str
    args: tuple = ()


@dataclass
class RPCShutdownRequest:
    """Leave the loop and exit."""


# ------------------------------------------------------------- engine -> client
@dataclass
class RPCRequestAccepted:
    request_id: str


@dataclass
class RPCError:
    """The engine refused a request (`request_id`), or an RPC failed (`request_id` None)."""

    request_id: str | None
    exception: BaseException


@dataclass
class RPCStepOutputs:
    """One step's outputs (or a multi-step run's partial outputs) and the step's statistics.

    `outputs` are deltas (`deltas.py`: the prompt once, then only what is new); the client
    rebuilds the cumulative `RequestOutput`s (a DELTA request's outputs travel as they are)."""

    outputs: list
    stats: list = field(default_factory=list)


@dataclass
class RPCStepFailed:
    """A step raised: these requests were aborted with it (the engine process goes on)."""

    request_ids: list[str]
    message: str


@dataclass
class RPCHeartbeat:
    """The engine process is alive; `error` says why it cannot serve even so (its loop hangs)."""

    error: str | None = None


@dataclass
class RPCResponse:
    """The answer to an RPC: a result, or the exception to raise in the caller."""

    result: Any = None
    exception: BaseException | None = None
