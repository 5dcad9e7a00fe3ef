"""The server notices an engine process that stops: frozen (SIGSTOP), killed, or orphaned.

Real processes throughout: the engine in its own process behind a `ServerThread`, and for the
orphan case a whole `minivllm serve` process killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.multiprocessing.client import HEARTBEAT_TIMEOUT_S, MQLLMEngineClient
from minivllm.entrypoints.openai.api_server import ServerThread, build_app

from .conftest import MODEL_NAME

ARGS = dict(device="cpu", seed=0, max_model_len=1024, max_num_seqs=8, num_gpu_blocks_override=128, swap_space=0.01)
LONG = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
# How soon after the heartbeats stop the server must say so (the client checks every second).
NOTICE_MARGIN_S = 3.0
# What "answers at once" means on a busy two-core machine (a held event loop takes minutes).
RESPONSIVE_S = 2.0


def read_stream(url: str, body: dict, lines: list[str], started: threading.Event) -> None:
    """Collect a stream's events; a server killed mid-stream just ends it."""
    with contextlib.suppress(httpx.RemoteProtocolError), \
            httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                started.set()


def test_a_frozen_engine_is_noticed_and_the_server_stays_responsive(tmp_path, monkeypatch):
    """SIGSTOP the engine with a stream running, and an adapter load and a request waiting on
    it: /health says 503 within seconds, the stream ends with an error that says what happened,
    the load, the waiting request and new requests get 503, and /v1/models and /metrics answer
    at once all the while."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    adapter = tmp_path / "adapter"  # reaches the engine's add_lora, where the freeze holds it
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    engine = MQLLMEngineClient.from_engine_args(EngineArgs(**ARGS, enable_lora=True, max_lora_rank=8))
    try:
        with ServerThread(build_app(engine, MODEL_NAME)) as server:
            lines: list[str] = []
            started = threading.Event()
            reader = threading.Thread(target=read_stream, args=(server.url, LONG, lines, started), daemon=True)
            reader.start()
            assert started.wait(30)
            os.kill(engine.process.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            load: dict = {}
            loader = threading.Thread(target=lambda: load.update(answer=httpx.post(
                server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)},
                timeout=60)), daemon=True)
            loader.start()
            waiting: dict = {}  # sent during the freeze: its engine never accepts it
            waiter = threading.Thread(target=lambda: waiting.update(answer=httpx.post(
                server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=60)), daemon=True)
            waiter.start()
            while True:
                for path in ("/v1/models", "/metrics"):  # the event loop is never held by the load
                    start = time.monotonic()
                    assert httpx.get(server.url + path, timeout=5).status_code == 200
                    assert time.monotonic() - start < RESPONSIVE_S, path
                health = httpx.get(server.url + "/health", timeout=5)
                if health.status_code != 200:
                    break
                assert time.monotonic() - frozen_at < HEARTBEAT_TIMEOUT_S + NOTICE_MARGIN_S, "freeze not noticed"
                time.sleep(0.2)
            assert health.status_code == 503 and "heartbeat" in health.json()["error"]["message"], health.text
            reader.join(10)
            assert not reader.is_alive() and lines[-1] == "[DONE]"
            error = json.loads(lines[-2])["error"]  # in-band: the stream's 200 was sent long ago
            assert "heartbeat" in error["message"]
            loader.join(10)
            assert load["answer"].status_code == 503, load["answer"].text
            waiter.join(10)
            assert waiting["answer"].status_code == 503 and "heartbeat" in waiting["answer"].text
            fresh = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=10)
            assert fresh.status_code == 503 and "heartbeat" in fresh.json()["error"]["message"], fresh.text
    finally:
        os.kill(engine.process.pid, signal.SIGKILL)  # a stopped process takes SIGKILL
        engine.shutdown()


def test_a_killed_engine_is_a_503_not_a_500():
    engine = MQLLMEngineClient.from_engine_args(EngineArgs(**ARGS))
    try:
        with ServerThread(build_app(engine, MODEL_NAME)) as server:
            assert httpx.get(server.url + "/health").status_code == 200
            os.kill(engine.process.pid, signal.SIGKILL)
            engine.process.join(10)
            answer = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=10)
            assert answer.status_code == 503
            assert "exit code -9" in answer.json()["error"]["message"]
            health = httpx.get(server.url + "/health")
            assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ a killed server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an orphaned zombie waits for a reaper that may never come in a container


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_the_engine_process_exits_within_seconds_of_its_server_dying(tmp_path):
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port", str(port),
         "--uvicorn-log-level", "warning", *[f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]],
        stdout=log, stderr=subprocess.STDOUT)
    engine_pid = None
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        [engine_pid] = _children(server.pid)
        lines: list[str] = []
        started = threading.Event()
        # A long request keeps the engine busy: the engine must not wait for it to end.
        body = {**LONG, "prompt": ["ROMEO:"] * 4}
        threading.Thread(target=read_stream, args=(url, body, lines, started), daemon=True).start()
        assert started.wait(30)
        server.kill()
        server.wait()
        killed_at = time.monotonic()
        while _running(engine_pid) and time.monotonic() - killed_at < 30:
            time.sleep(0.05)
        assert time.monotonic() - killed_at < 5.0
    finally:
        server.kill()
        server.wait()
        if engine_pid is not None and _running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)

