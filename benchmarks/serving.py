"""Online serving benchmark: Poisson arrivals against a running server, latency percentiles.

In the spirit of vLLM's `benchmarks/benchmark_serving.py`. For each request rate, requests
arrive as a Poisson process (exponential gaps with mean 1 / rate); each streams a completion
and we time, per request:

    TTFT  time to first token:   request sent -> first streamed token
    TPOT  time per output token: (latency - TTFT) / (output tokens - 1)
    ITL   inter-token latency:   the gap between two streamed chunks
    E2E   end-to-end latency:    request sent -> last token

and per run the request and output-token throughput. Prompts are random token ids (drawn
from ids the server's own tokenizer produces) and every request generates exactly
`--output-len` tokens (`ignore_eos`), so runs compare like with like.

    minivllm serve --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rates 2 8 \\
        --num-prompts 32 --json benchmarks/results/serving_cpu.json --plot serving.png

The benchmark talks only to a server on this machine (loopback) and is bounded: at most
`--num-prompts` requests and `--max-duration` seconds of arrivals per rate.

`--workload` starts `minivllm serve` itself on a random-weight checkpoint
(`nano_vllm_workload.py build` makes one) with nano-vllm's engine arguments (model, dtype,
max_model_len 4096, every other argument at its default) and sends nano-vllm's whole
workload at once: 256 concurrent streaming clients, each its request's prompt token ids,
max_tokens, temperature 0.6, ignore_eos, after bench.py's one-line warm-up. It checks each
request's completion_tokens against its max_tokens and reports output tokens/s; the offline
figure to compare with is nano_vllm_workload.py's headline row of the same run (same engine arguments,
same workload, same sampling).

    python benchmarks/serving.py --workload --ckpt /tmp/ckpt/qwen3-0.6b --json serving_workload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import string
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PERCENTILES = (50, 90, 99)
_REQUEST_TIMEOUT_S = 300.0


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ----------------------------------------------------------------- the client
async def stream_one(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """Send one streaming completion and time its chunks."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, timeout=_REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = last - start
        result.success = result.output_tokens > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = repr(e)
    return result


async def token_pool(client: httpx.AsyncClient, base_url: str) -> list[int]:
    """Token ids that exist in the server's vocabulary (its tokenizer's ids for plain text)."""
    text = " ".join(string.ascii_letters + string.digits) + " " + string.punctuation
    response = await client.post(f"{base_url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return sorted(set(response.json()["tokens"]))


async def run_at_rate(client, base_url, model, rate, prompts, output_len, max_duration, rng) -> dict:
    """Fire `prompts` as a Poisson process of `rate` requests/s; gather the results."""
    url = f"{base_url}/v1/completions"
    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        payload = {
            "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        tasks.append(asyncio.create_task(stream_one(client, url, payload)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        if time.perf_counter() - start > max_duration:
            break
    results = await asyncio.gather(*tasks)
    run = summarize(rate, results, time.perf_counter() - start)
    # On a shared machine other processes compete for the cores: record how busy it was.
    run["load_avg_1m"] = os.getloadavg()[0]
    return run


# ---------------------------------------------------------------- statistics
def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def describe_ms(values: list[float]) -> dict[str, float]:
    stats = {"mean": statistics.fmean(values) * 1000 if values else float("nan")}
    stats.update({f"p{p}": percentile(values, p) * 1000 for p in PERCENTILES})
    return stats


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "request_rate": rate,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": describe_ms([r.ttft for r in ok]),
        "tpot_ms": describe_ms(tpots),
        "itl_ms": describe_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": describe_ms([r.latency for r in ok]),
    }


# ---------------------------------------------------------------------- plot
def plot(runs: list[dict], path: str, title: str) -> None:
    """Latency percentiles and achieved throughput against the offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.viz.style import COLORS

    rates = [run["request_rate"] for run in runs]
    labels = [("inf" if r == float("inf") else f"{r:g}") for r in rates]
    xs = range(len(runs))
    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, name, colour in (("ttft_ms", "TTFT", COLORS["prompt"]), ("tpot_ms", "TPOT", COLORS["generated"])):
        ax_lat.plot(xs, [run[key]["p50"] for run in runs], "o-", color=colour, label=f"{name} p50")
        ax_lat.plot(xs, [run[key]["p99"] for run in runs], "s--", color=colour, label=f"{name} p99")
    ax_lat.set(xticks=list(xs), xticklabels=labels, xlabel="offered rate (requests/s)", ylabel="ms", title="latency")
    ax_lat.legend(fontsize=8)
    ax_tput.bar(xs, [run["output_throughput"] for run in runs], color=COLORS["generated"])
    for x, run in zip(xs, runs):
        ax_tput.annotate(f"{run['request_throughput']:.2f} req/s", (x, run["output_throughput"]), ha="center", va="bottom", fontsize=8)
    ax_tput.set(xticks=list(xs), xticklabels=labels, xlabel="offered rate (requests/s)", ylabel="output tokens/s", title="throughput")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------- main
# ---------------------------------------------------- nano-vllm's workload
SERVER_START_TIMEOUT_S = 180.0
WORKLOAD_TEMPERATURE = 0.6


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(ckpt: str, dtype: str, max_model_len: int, port: int, log_path: str, extra: list[str] = ()):
    """`minivllm serve` in a child process, with nano-vllm's engine arguments only (and `extra`)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "minivllm", "serve", ckpt, "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning", *extra]
    log = open(log_path, "w")  # noqa: SIM115 (the child writes to it until it ends)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), cmd


async def wait_healthy(base_url: str, proc, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    async with httpx.AsyncClient() as client:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy")
            try:
                if (await client.get(f"{base_url}/health", timeout=2.0)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


async def _stream_all(url: str, payloads: list[dict], start_at: float) -> tuple[list[RequestResult], float]:
    """Every payload at once from one client, at wall-clock `start_at`; the results and the end time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        results = await asyncio.gather(*(stream_one(client, url, payload) for payload in payloads))
    return list(results), time.time()


def _client_process(url: str, payloads: list[dict], start_at: float) -> tuple[list[RequestResult], float, float]:
    """One client process's streams; also its CPU seconds (a client near 100 % of a core measures itself)."""
    cpu = time.process_time()
    results, end = asyncio.run(_stream_all(url, payloads, start_at))
    return results, end, time.process_time() - cpu


async def send_workload(base_url: str, prompts: list[list[int]], max_tokens: list[int], temperature: float,
                        client_processes: int = 1, on_warm=None) -> dict:
    """bench.py's warm-up, then every request at once, each streaming; tokens checked per request.

    `client_processes` > 1 splits the clients over that many processes: one Python process
    reading ~10,000 SSE chunks a second with httpx is itself at 100 % of a core, and then it
    measures itself, not the server (every chunk already waits in its socket buffer).
    """
    async with httpx.AsyncClient() as client:
        model = (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        warmup = {"model": model, "prompt": "Benchmark: ", "max_tokens": 64, "temperature": 1.0}
        (await client.post(f"{base_url}/v1/completions", json=warmup, timeout=_REQUEST_TIMEOUT_S)).raise_for_status()
    if on_warm is not None:
        on_warm()
    url = f"{base_url}/v1/completions"
    payloads = [{"model": model, "prompt": p, "max_tokens": m, "temperature": temperature, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}} for p, m in zip(prompts, max_tokens)]
    if client_processes <= 1:
        start, cpu = time.time(), time.process_time()
        results, end = await _stream_all(url, payloads, start)
        client_cpu = [time.process_time() - cpu]
    else:
        import concurrent.futures
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(client_processes, mp_context=context) as pool:
            list(pool.map(time.sleep, [0.0] * client_processes))  # every process up before the clock starts
            start = time.time() + 1.0
            parts = [pool.submit(_client_process, url, payloads[i::client_processes], start)
                     for i in range(client_processes)]
            done = [await asyncio.wrap_future(part) for part in parts]
        results = [None] * len(payloads)
        for i, (part_results, _, _) in enumerate(done):
            results[i::client_processes] = part_results
        end = max(part_end for _, part_end, _ in done)
        client_cpu = [part_cpu for _, _, part_cpu in done]
    elapsed = end - start
    run = summarize(float("inf"), results, elapsed)
    wrong = [i for i, (r, m) in enumerate(zip(results, max_tokens)) if r.output_tokens != m]
    run.update(model=model, num_clients=len(prompts), client_processes=client_processes,
               output_tokens=sum(r.output_tokens for r in results),
               expected_output_tokens=sum(max_tokens), tokens_checked=not wrong, wrong_token_counts=len(wrong),
               streamed_chunks=sum(len(r.itl) + 1 for r in results if r.success),
               elapsed_s=round(elapsed, 3), output_tokens_per_s=round(sum(r.output_tokens for r in results) / elapsed, 1),
               sampling_params={"temperature": temperature, "ignore_eos": True},
               client_cpu_busy=[round(c / elapsed, 2) for c in client_cpu])  # share of a core, per client process
    return run


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (Linux's /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class ServerProfile:
    """py-spy sampling the server and its engine process (`--subprocesses`) while the workload
    runs: where the host's time goes, one speedscope profile per thread, waits included (`--idle`: a
    thread blocked on the GPU or a socket shows where it waits). py-spy samples from
    outside without pausing the processes (`--nonblocking`); it needs permission to attach
    (ptrace), so a machine that refuses leaves its error in the report instead."""

    def __init__(self, server_pid: int, path: str) -> None:
        self.server_pid, self.path, self.proc, self.error = server_pid, path, None, ""

    def start(self) -> None:
        import shutil
        import subprocess

        py_spy = shutil.which("py-spy")
        if py_spy is None:
            self.error = "py-spy is not installed"
            return
        cmd = [py_spy, "record", "--pid", str(self.server_pid), "--subprocesses", "--idle", "--nonblocking", "--rate", "200",
               "--format", "speedscope", "--output", self.path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)  # attached before the clock starts
        if self.proc.poll() is not None:
            self.error = f"py-spy exited at once: {self.proc.stdout.read()[-500:]}"

    def stop(self) -> dict:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its profile on Ctrl-C
            try:
                log = self.proc.communicate(timeout=60)[0]
                self.error = "" if os.path.exists(self.path) else log[-500:]
            except Exception as e:  # noqa: BLE001 (a profile is extra; the run's numbers stand)
                self.proc.kill()
                self.error = f"py-spy did not stop: {e!r}"
        return {"path": self.path if os.path.exists(self.path) else None, "error": self.error}


def run_workload(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from common import NANO_MAX_MODEL_LEN, engine_args_used, row_workload

    spec = {"num_seqs": args.num_prompts_workload or 256}
    if args.smoke:
        spec.update(num_seqs=args.num_prompts_workload or 4, prompt_cap=48, max_tokens_cap=8)
    if args.max_tokens_cap:
        spec.update(max_tokens_cap=args.max_tokens_cap)
    prompts, max_tokens = row_workload(spec)
    dtype = "float32" if args.smoke else "bfloat16"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = args.server_log or (str(Path(args.json).with_suffix(".server.log")) if args.json
                                   else "minivllm_serving_server.log")
    start = time.perf_counter()
    proc, cmd = start_server(args.ckpt, dtype, NANO_MAX_MODEL_LEN, port, log_path, args.server_arg or [])
    try:
        asyncio.run(wait_healthy(base_url, proc, SERVER_START_TIMEOUT_S))
        startup_s = time.perf_counter() - start
        profile = ServerProfile(proc.pid, args.profile_server) if args.profile_server else None
        cpu_at_start = []

        def on_warm() -> None:
            cpu_at_start.append(process_cpu_s(proc.pid))
            if profile is not None:
                profile.start()

        run = asyncio.run(send_workload(base_url, prompts, max_tokens, WORKLOAD_TEMPERATURE, args.client_processes,
                                        on_warm=on_warm))
        cpu_s = process_cpu_s(proc.pid)
        if cpu_s is not None and cpu_at_start[0] is not None:
            # The API server's own process (the engine runs in a child of it): its CPU time
            # per streamed token, a cost that does not depend on how fast the GPU is.
            run["server_cpu_s"] = round(cpu_s - cpu_at_start[0], 3)
            run["server_cpu_us_per_token"] = round(1e6 * run["server_cpu_s"] / max(run["output_tokens"], 1), 1)
        if profile is not None:
            run["server_profile"] = profile.stop()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except Exception:  # noqa: BLE001 (a server that ignores SIGTERM still must not outlive us)
            proc.kill()
    run.update(server_cmd=cmd, server_log=log_path, server_startup_s=round(startup_s, 2), spec=spec,
               engine_args=engine_args_used({"model": args.ckpt, "dtype": dtype, "max_model_len": NANO_MAX_MODEL_LEN}),
               machine=machine())
    print(json.dumps({k: v for k, v in run.items() if k not in ("engine_args", "machine")}), flush=True)
    return run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="store_true",
                        help="start a server on --ckpt and send nano-vllm's workload, all clients at once")
    parser.add_argument("--ckpt", default=None, help="with --workload: the checkpoint to serve")
    parser.add_argument("--num-prompts-workload", type=int, default=None,
                        help="with --workload: clients (default 256; 4 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="with --workload: 4 tiny requests, fp32 (CPU)")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help="with --workload: at most this many tokens per request (e.g. with --smoke, more streams)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="with --workload: split the clients over this many processes (one Python process "
                             "reading every stream saturates first)")
    parser.add_argument("--server-arg", action="append", default=None,
                        help="with --workload: one more `minivllm serve` argument (repeatable), e.g. "
                             "--server-arg=--disable-frontend-multiprocessing")
    parser.add_argument("--profile-server", default=None, metavar="PATH",
                        help="with --workload: py-spy records the server's processes during the workload (speedscope JSON)")
    parser.add_argument("--server-log", default=None, help="with --workload: the server's output (default: beside --json)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--request-rates", type=float, nargs="+", default=[1.0, 4.0], help="requests/s; inf = all at once")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=16, help="generated tokens per request")
    parser.add_argument("--max-duration", type=float, default=120.0, help="seconds of arrivals per rate, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write the figure here (.png)")
    args = parser.parse_args(argv)
    if urlparse(args.base_url).hostname not in LOOPBACK_HOSTS:
        parser.error(f"--base-url must be a loopback address {LOOPBACK_HOSTS}: this benchmark only loads local servers.")
    return args


async def main(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model or (await client.get(f"{args.base_url}/v1/models")).json()["data"][0]["id"]
        pool = await token_pool(client, args.base_url)
        runs = []
        for rate in args.request_rates:
            prompts = [[rng.choice(pool) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
            run = await run_at_rate(client, args.base_url, model, rate, prompts, args.output_len, args.max_duration, rng)
            runs.append(run)
            print(format_run(run))
    return {"config": vars(args), "model": model, "machine": machine(), "runs": runs}


def format_run(run: dict) -> str:
    def ms(key: str) -> str:
        d = run[key]
        return f"{key[:-3].upper()} mean {d['mean']:.1f} / p50 {d['p50']:.1f} / p99 {d['p99']:.1f} ms"

    return (
        f"rate {run['request_rate']:g} req/s: {run['completed']}/{run['num_requests']} ok in {run['duration_s']:.1f} s, "
        f"{run['request_throughput']:.2f} req/s, {run['output_throughput']:.1f} tok/s | "
        + " | ".join(ms(k) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    )


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(), "python": platform.python_version()}


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.workload:
        report = run_workload(arguments)
        if arguments.json:
            with open(arguments.json, "w") as f:
                json.dump(report, f, indent=2)
        raise SystemExit(0 if report["tokens_checked"] and report["completed"] == report["num_requests"] else 1)
    report = asyncio.run(main(arguments))
    if arguments.json:
        with open(arguments.json, "w") as f:
            json.dump(report, f, indent=2)
    if arguments.plot:
        plot(report["runs"], arguments.plot, f"serving {report['model']} ({report['machine']['cpu_count']} CPU cores)")
