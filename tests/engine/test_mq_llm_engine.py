"""The engine in its own process (`MQLLMEngine` + `MQLLMEngineClient`): the same streams as
the engine in-process, errors only for their caller, aborts that free every block, and a dead
engine process that fails every request within seconds instead of hanging.

The reference for tokens is the same engine arguments driven synchronously in this process.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import zmq

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm_engine import EngineStepError
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import StatLoggerBase
from minivllm.engine.multiprocessing import (IPC_HEARTBEAT_EXT, IPC_INPUT_EXT, IPC_RPC_EXT, MQEngineDeadError,
                                             RPCAbortRequest, RPCProcessRequest)
from minivllm.engine.multiprocessing.client import HEARTBEAT_TIMEOUT_S, MQLLMEngineClient
from minivllm.engine.multiprocessing.engine import MQLLMEngine
from minivllm.sampling_params import SamplingParams

ARGS = dict(device="cpu", seed=0, max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=64, swap_space=0.01)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
PROMPTS = ["ROMEO:", "JULIET:", "To be, or not", "KING HENRY"]


class Recorder(StatLoggerBase):
    def __init__(self) -> None:
        self.stats = []

    def log(self, stats) -> None:
        self.stats.append(stats)


@pytest.fixture(scope="module")
def client():
    client = MQLLMEngineClient.from_engine_args(EngineArgs(**ARGS))
    client.add_logger("recorder", Recorder())
    yield client
    client.shutdown()


def run(client: MQLLMEngineClient, coroutine):
    async def main():
        try:
            return await coroutine
        finally:
            await client.stop_background_loop()

    return asyncio.run(main())


async def collect(client, request_id, prompt, params=GREEDY):
    return [output async for output in client.generate(prompt, params, request_id)]


def reference(prompts, params=GREEDY):
    engine = LLMEngine.from_engine_args(EngineArgs(**ARGS))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[str(i)].outputs[0] for i in range(len(prompts))]


def test_concurrent_streams_match_the_engine_in_this_process(client):
    async def body():
        return await asyncio.gather(*(collect(client, f"c{i}", p) for i, p in enumerate(PROMPTS)))

    streams = run(client, body())
    for outputs, expected in zip(streams, reference(PROMPTS)):
        texts = [o.outputs[0].text for o in outputs]
        assert len(outputs) == GREEDY.max_tokens  # token by token across the process boundary
        assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:]))
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected.token_ids
        assert texts[-1] == expected.text
    assert client.engine_config.model_config.max_model_len == 256  # the engine's own config
    assert client.get_tokenizer().decode(streams[0][-1].outputs[0].token_ids) == streams[0][-1].outputs[0].text


def test_a_rejected_request_fails_only_its_caller(client):
    async def body():
        with pytest.raises(ValueError, match="empty"):
            await client.add_request("bad", "", GREEDY)
        too_long = await collect(client, "long", {"prompt_token_ids": [5] * 300})  # can never fit
        return too_long, await collect(client, "good", PROMPTS[0])

    too_long, outputs = run(client, body())
    assert too_long[-1].finished and "max_model_len" in too_long[-1].outputs[0].finish_message
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference(PROMPTS[:1])[0].token_ids
    assert not client.streams and not client._wire_ids  # nothing left behind, rejected or finished


def test_abort_ends_the_stream_and_the_engine_returns_every_block(client):
    recorder = client.stat_loggers["recorder"]

    async def body():
        stream = await client.add_request("to-abort", PROMPTS[1], LONG)
        received = []
        async for output in stream.generator():
            received.append(output)
            if len(received) == 3:
                await client.abort("to-abort")
        # The engine applies the abort before its next step; an empty step then reports.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (recorder.stats and recorder.stats[-1].num_running_sys == 0):
            await asyncio.sleep(0.05)
        return received

    received = run(client, body())
    assert 3 <= len(received) < LONG.max_tokens and not received[-1].finished
    last = recorder.stats[-1]
    assert last.num_running_sys == last.num_waiting_sys == 0
    assert last.gpu_cache_usage_sys == 0.0  # every block back in the engine process's pool


def test_stats_reach_the_loggers_of_this_process(client):
    recorder = client.stat_loggers["recorder"]
    before = len(recorder.stats)
    outputs = run(client, collect(client, "counted", PROMPTS[2]))
    new = recorder.stats[before:]
    assert sum(s.num_generation_tokens_iter for s in new) == GREEDY.max_tokens
    assert sum(s.num_prompt_tokens_iter for s in new) == len(outputs[-1].prompt_token_ids)


def test_a_killed_engine_process_fails_requests_within_seconds():
    client = MQLLMEngineClient.from_engine_args(EngineArgs(**ARGS))
    ipc_dir = Path(client.ipc_path.removeprefix("ipc://")).parent

    async def body():
        stream = await client.add_request("doomed", PROMPTS[0], LONG)
        outputs = stream.generator()
        await outputs.__anext__()  # it is running
        os.kill(client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(MQEngineDeadError):
            async for _ in outputs:
                pass
        waited = time.monotonic() - start
        with pytest.raises(RuntimeError, match="exit code"):
            await client.check_health()
        with pytest.raises(MQEngineDeadError):
            await client.add_request("after", PROMPTS[0], GREEDY)
        return waited

    try:
        waited = run(client, body())
    finally:
        client.shutdown()
    assert waited < 5.0  # noticed by the output loop's liveness check (every second), not a hang
    assert isinstance(MQEngineDeadError("x"), EngineStepError)  # a step error's kind (the server answers 503)
    assert not client.process.is_alive() and not ipc_dir.exists()
    # Both contexts closed here, not left to the GC: a context collected in one cycle with its
    # open socket waits forever in term() (this once hung the suite in the next test's GC pass).
    assert client.ctx.closed and client.actx.closed


def test_shutdown_stops_the_engine_process_and_removes_its_sockets():
    client = MQLLMEngineClient.from_engine_args(EngineArgs(**ARGS))
    ipc_dir = Path(client.ipc_path.removeprefix("ipc://")).parent
    assert client.process.is_alive() and ipc_dir.exists()
    client.shutdown()
    assert client.process.exitcode == 0  # it left its loop on the shutdown message, not killed
    assert not ipc_dir.exists()


def test_bad_engine_arguments_raise_here_before_any_process_starts():
    with pytest.raises(ValueError):
        MQLLMEngineClient.from_engine_args(EngineArgs(**{**ARGS, "max_num_seqs": 0}))


def test_rpcs_between_steps_return_results_and_raise_the_engines_errors(client):
    from minivllm.lora.request import LoRARequest

    assert client.remove_lora(7) is False  # answered by the engine process: it knows no adapter 7
    with pytest.raises(ValueError, match="enable_lora"):  # the engine's own ValueError, raised here
        client.add_lora(LoRARequest("sql", 1, "/nowhere"))
    outputs = run(client, collect(client, "after-rpc", PROMPTS[0]))  # the engine went on
    assert outputs[-1].finished


def test_a_reused_request_id_never_sees_the_aborted_requests_outputs(client):
    async def body():
        first = await client.add_request("same", PROMPTS[1], LONG)
        await client.abort("same")  # outputs of this one may still be on their way
        second = await collect(client, "same", PROMPTS[0])
        return [o async for o in first.generator()], second

    leftovers, outputs = run(client, body())
    assert leftovers == [] or not leftovers[-1].finished
    assert outputs[-1].request_id == "same"  # the caller's id, not the wire's
    assert outputs[-1].outputs[0].token_ids == reference(PROMPTS[:1])[0].token_ids


def test_stopping_the_loop_fails_the_requests_in_flight(client):
    async def body():
        stream = await client.add_request("cut", PROMPTS[2], LONG)
        await client.stop_background_loop()
        with pytest.raises(EngineStepError, match="stopped"):
            async for _ in stream.generator():
                pass
        return await collect(client, "next-loop", PROMPTS[0])  # a new loop serves again

    outputs = run(client, body())
    assert outputs[-1].finished


def test_shutdown_from_another_thread_than_the_output_loops_closes_everything():
    """The output loop runs in a thread of its own (as a server or notebook thread would);
    `shutdown()` from this thread hands the cancel to that loop, whose `finally` closes the
    output socket there: no zmq socket is touched from two threads, nothing is left open."""
    import threading

    client = MQLLMEngineClient.from_engine_args(EngineArgs(**ARGS))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        outputs = asyncio.run_coroutine_threadsafe(collect(client, "t", PROMPTS[0]), loop).result(60)
        assert outputs[-1].finished and client.is_running  # the loop reads on, in its thread
        client.shutdown()
        for _ in range(100):  # the cancel runs on the loop's thread
            if not client.is_running:
                break
            time.sleep(0.05)
        assert not client.is_running and client.ctx.closed and client.actx.closed
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_malformed_frame_on_the_engines_sockets_is_dropped_and_the_engine_goes_on(client):
    """Garbage on the input socket (not a pickle, several frames, a foreign object, a request
    whose fields are wrong) and on the RPC socket (answered with an error, as the REP socket
    must answer): the engine process logs and drops each, and serves on."""
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(client.ipc_path + IPC_INPUT_EXT)
        push.send(b"\x80not a pickle")
        push.send_multipart([b"two", b"frames"])
        push.send(pickle.dumps("a string"))
        push.send(pickle.dumps(RPCAbortRequest(request_ids=7)))  # not a list
        push.send(pickle.dumps(RPCProcessRequest(["unhashable"], "ROMEO:", GREEDY, 0.0)))
        req = ctx.socket(zmq.REQ)
        req.connect(client.ipc_path + IPC_RPC_EXT)
        req.send(b"\x80garbage")
        assert req.poll(30_000), "the RPC socket did not answer"
        assert isinstance(pickle.loads(req.recv()).exception, ValueError)
        push.close(linger=1000)  # delivered before the request below
    finally:
        ctx.destroy(linger=1000)
    outputs = run(client, collect(client, "after-garbage", PROMPTS[0]))
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference(PROMPTS[:1])[0].token_ids
    assert client.process.is_alive() and not client.errored


def test_an_event_loop_held_longer_than_the_heartbeat_timeout_is_not_a_frozen_engine(client):
    """The heartbeats that came while this process's event loop was held wait in the socket:
    the first look after the hold finds a fresh one, and the engine serves on."""
    async def body():
        await collect(client, "before-hold", PROMPTS[0])  # the output loop reads heartbeats
        time.sleep(HEARTBEAT_TIMEOUT_S + 1)  # holds the event loop (a blocking call in a server)
        return await collect(client, "after-hold", PROMPTS[0])

    outputs = run(client, body())
    assert outputs[-1].finished and not client.errored


class _IdleEngine:
    """What MQLLMEngine needs of an LLMEngine when its loop never runs."""

    def add_logger(self, name, logger) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_the_heartbeat_says_when_the_engine_loop_stops_coming_round(tmp_path):
    """A loop that never comes round (a step that hangs) is reported by the heartbeat thread,
    which beats on while the process lives."""
    ipc_path = f"ipc://{tmp_path}/engine"
    engine = MQLLMEngine(_IdleEngine(), ipc_path, loop_stall_timeout_s=1.0)
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.connect(ipc_path + IPC_HEARTBEAT_EXT)
        beats = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (beats and beats[-1].error):
            if pull.poll(1000):
                beats.append(pull.recv_pyobj())
        assert beats[0].error is None  # fresh: healthy
        assert "has not come round" in beats[-1].error
    finally:
        ctx.destroy(linger=0)
        engine.close()


_HUNG_ENGINE_SCRIPT = """
import multiprocessing, sys, time
from minivllm.engine.multiprocessing.engine import MQLLMEngine

class IdleEngine:
    def add_logger(self, name, logger): pass
    def shutdown(self): pass

def hung_engine(ipc_path):
    MQLLMEngine(IdleEngine(), ipc_path)
    time.sleep(600)  # a step that never returns

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=hung_engine, args=(sys.argv[1],))
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


def test_an_orphaned_engine_process_exits_even_if_its_step_hangs(tmp_path):
    """The server's process is killed while the engine is inside a step that never returns:
    the heartbeat thread ends the engine process a few seconds later anyway."""
    import subprocess
    import sys

    from minivllm.engine.multiprocessing.engine import _ORPHAN_GRACE_S

    script = tmp_path / "server.py"
    script.write_text(_HUNG_ENGINE_SCRIPT)
    ipc_path = f"ipc://{tmp_path}/engine"
    server = subprocess.Popen([sys.executable, str(script), ipc_path], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    engine_pid = None
    try:
        engine_pid = int(server.stdout.readline())
        pull = ctx.socket(zmq.PULL)
        pull.connect(ipc_path + IPC_HEARTBEAT_EXT)
        assert pull.poll(60_000), "the engine process did not start"  # its first heartbeat
        server.kill()
        server.wait()
        killed_at = time.monotonic()
        while _running(engine_pid) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        assert not _running(engine_pid)
        assert time.monotonic() - killed_at < _ORPHAN_GRACE_S + 3
    finally:
        ctx.destroy(linger=0)
        server.kill()
        if engine_pid is not None and _running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an orphaned zombie waits for a reaper that may never come in a container
