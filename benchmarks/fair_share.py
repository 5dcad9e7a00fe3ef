"""A small request's time to first token while one client sends a huge load, and the server's memory.

Two loads against `minivllm serve` on the bundled model (CPU), each measured against the
same small streaming request on the idle server:

    fan-out   one request of 64 prompts x n=64 (4,096 sequences), the small requests from 2 s on
    long      six concurrent prompts of 3.9 MB of random words each, the small requests alongside

With the server's default limits the fan-out request gets a 400 (prompts x n above
--max-seqs-per-request); `--accept-fan-out` raises the cap so that it runs, which measures
how its prompts are interleaved with the small requests. Memory is the resident size of the
server and its engine process (/proc), before, at the peak of and after each load.

    python benchmarks/fair_share.py                    # the default limits
    python benchmarks/fair_share.py --accept-fan-out   # the 4,096 sequences run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

MODEL = "tiny-shakespeare"
SMALL = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 2, "stream": True, "temperature": 0.0}
FAN_OUT = {"model": MODEL, "prompt": [f"Scene {i}. Enter ROMEO." for i in range(64)], "n": 64, "max_tokens": 16}
NUM_LONG_CHARS = 3_900_000


def long_text(seed: int) -> str:
    """3.9 MB of random lowercase words: no token repeats often enough to be cheap to encode."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 12))) for _ in range(50_000)]
    text = " ".join(rng.choices(words, k=NUM_LONG_CHARS // 6))
    return (text * 2)[:NUM_LONG_CHARS]
NUM_LONG, NUM_SMALL, SMALL_EVERY_S, FAN_OUT_DELAY_S = 6, 5, 1.0, 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its children (the engine process), MiB."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return round(total / 1024, 1)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class PeakMemory:
    """Samples rss_mib every 0.1 s in a thread; `.peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.1)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def small_ttft(client: httpx.AsyncClient, url: str) -> float:
    """Seconds from sending the small request to its first streamed token."""
    start, ttft = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json=SMALL, timeout=600) as response:
        async for line in response.aiter_lines():  # read to the end: the request finishes
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"no token from the small request (status {response.status_code})")
    return ttft


async def smalls(client: httpx.AsyncClient, url: str, delay: float) -> list[float]:
    await asyncio.sleep(delay)
    ttfts = []
    for _ in range(NUM_SMALL):
        ttfts.append(await small_ttft(client, url))
        await asyncio.sleep(SMALL_EVERY_S)
    return ttfts


async def fan_out_load(client, url) -> tuple[list[float], dict]:
    async def big():
        start = time.perf_counter()
        response = await client.post(url + "/v1/completions", json=FAN_OUT, timeout=3600)
        return {"status": response.status_code, "seconds": round(time.perf_counter() - start, 2),
                "error": response.json().get("error", {}).get("message") if response.status_code != 200 else None}

    big_result, ttfts = await asyncio.gather(big(), smalls(client, url, FAN_OUT_DELAY_S))
    return ttfts, big_result


async def long_load(client, url) -> tuple[list[float], dict]:
    bodies = [json.dumps({"model": MODEL, "prompt": long_text(i), "max_tokens": 1}) for i in range(NUM_LONG)]

    async def one_long(body: str):
        response = await client.post(url + "/v1/completions", content=body, timeout=600,
                                     headers={"content-type": "application/json"})
        return response.status_code, response.json().get("error", {}).get("message", "")[:160]

    statuses, ttfts = await asyncio.gather(asyncio.gather(*(one_long(b) for b in bodies)),
                                           smalls(client, url, 0.05))
    return ttfts, {"answers": sorted(set(statuses))}


def summary(ttfts: list[float]) -> dict:
    return {"median_s": round(statistics.median(ttfts), 3), "max_s": round(max(ttfts), 3)}


LOADS = {"fan_out": fan_out_load, "long": long_load}


async def measure(url: str, pid: int, loads: list[str]) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        for _ in range(3):  # warm-up
            await small_ttft(client, url)
        idle = [await small_ttft(client, url) for _ in range(NUM_SMALL)]
        result = {"idle": summary(idle), "baseline_mib": rss_mib(pid)}
        for name in loads:
            load = LOADS[name]
            with PeakMemory(pid) as memory:
                ttfts, detail = await load(client, url)
            await asyncio.sleep(2.0)
            result[name] = {**summary(ttfts), "vs_idle": round(statistics.median(ttfts) / result["idle"]["median_s"], 2),
                            **detail, "peak_mib": memory.peak, "after_mib": rss_mib(pid)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accept-fan-out", action="store_true", help="--max-seqs-per-request 4096")
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `minivllm serve` flags")
    args = parser.parse_args()
    port = free_port()
    extra = ["--max-seqs-per-request", "4096"] if args.accept_fan_out else []
    cmd = [sys.executable, "-m", "minivllm", "serve", "--device", "cpu", "--port", str(port),
           "--uvicorn-log-level", "warning", *extra, *args.extra]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        result = {"command": " ".join(cmd[1:]), **asyncio.run(measure(url, server.pid, args.loads)),
                  "env": {"commit": common.commit(), "cpus": os.cpu_count()}}
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
