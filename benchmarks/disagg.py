"""Prefill-decode disaggregation: time to first token and inter-token latency under a mixed
load, one instance doing both against a prefill instance and a decode instance.

The workload: `--num-decodes` streams decode `--decode-tokens` tokens each from short prompts;
while they run, `--num-long` requests with `--long-prompt`-token prompts arrive every
`--interval` seconds (each wants 16 tokens). Two setups, each on fresh servers:

    single   one `minivllm serve` on GPU 0
    split    a kv_producer on GPU 0 and a kv_consumer on GPU 1 sharing a SharedStorageConnector
             folder, behind `minivllm proxy` (prefill with max_tokens=1, then decode)

Reported: each side's KV-transfer gauges after the split's run (seconds loading and saving,
bytes moved), and the decode streams' inter-token latency (p50, p99, max: the stall a long prefill
causes when it joins a decode batch) and the long requests' time to first token; and how many
long requests streamed the same greedy text on both setups (the KV really moved). Expected: the
split keeps the decode streams' ITL flat (no prefill ever enters their batches) at the price of
a higher TTFT (the prompt is prefilled, written to the store, read back, and its last block
recomputed on the consumer).

Without `--model` it builds a random Llama (~1B parameters, the bundled tokenizer) in a temporary
folder: timings need a model whose prefill costs something, not meaningful text.

    python benchmarks/disagg.py                           # 2 GPUs
    python benchmarks/disagg.py --fp32 --num-long 8 --interval 1   # 2 GPUs, a correctness run
    python benchmarks/disagg.py --device cpu --small      # a CPU smoke run of the harness
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from minivllm.bundled_models import resolve_model


def build_random_llama(folder: Path, small: bool, fp32: bool = False) -> str:
    """A random-weight Llama with the bundled tokenizer (bf16 unless small or fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    bundled = resolve_model(None)
    vocab = json.loads((Path(bundled) / "config.json").read_text())["vocab_size"]
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4) if small else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22)
    config = LlamaConfig(vocab_size=vocab, num_attention_heads=16 if not small else 4, num_key_value_heads=4,
                         max_position_embeddings=4096, architectures=["LlamaForCausalLM"], **size)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32 if small or fp32 else torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(bundled) / name, folder / name)
    return str(folder)


def start(args_list: list[str], gpu: str | None, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return subprocess.Popen([sys.executable, "-m", "minivllm", *args_list], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, path: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list[float], str]:
    """Arrival times of each streamed chunk, from the request's start (index 0: the first
    token), and the streamed text."""
    start, times, text = time.perf_counter(), [], []
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - start)
                text.append(json.loads(line[len("data: "):])["choices"][0]["text"])
    return times, "".join(text)


async def workload(url: str, args) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        # Untimed: one long and one short request through the whole path first, so that what
        # runs for the first time (Triton compiling the kernels of a prefill over loaded KV,
        # the store's first files) is not counted as a stall of the timed streams.
        for length in (args.long_prompt, 8):
            await stream(client, url, {"model": "m", "prompt": [(11 * j) % 500 + 3 for j in range(length)],
                                       "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        decodes = [asyncio.create_task(stream(client, url, dict(
            model="m", prompt=f"ROMEO {i}:", max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)))
            for i in range(args.num_decodes)]
        await asyncio.sleep(args.warmup)
        longs = []
        for i in range(args.num_long):
            prompt = {"model": "m", "prompt": [(7 * i + j) % 500 + 3 for j in range(args.long_prompt)],
                      "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            longs.append(asyncio.create_task(stream(client, url, prompt)))
            await asyncio.sleep(args.interval)
        decode_results, long_results = await asyncio.gather(*decodes), await asyncio.gather(*longs)
    decode_times, long_times = [t for t, _ in decode_results], [t for t, _ in long_results]
    gaps = sorted(b - a for times in decode_times for a, b in zip(times, times[1:]))
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1000  # noqa: E731
    return {"itl_p50_ms": q(0.5), "itl_p99_ms": q(0.99), "itl_max_ms": gaps[-1] * 1000,
            "long_ttft_mean_ms": statistics.mean(t[0] for t in long_times) * 1000,
            "long_texts": [text for _, text in long_results]}


def kv_transfer_gauges(url: str) -> dict[str, float]:
    """The server's `vllm:kv_transfer_*` gauges (tokens and bytes moved, seconds spent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split("{")[0].removeprefix("vllm:kv_transfer_"): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vllm:kv_transfer_")}


def run_setup(name: str, model: str, args, work: Path) -> dict:
    engine = ["--model", model, "--device", args.device, "--served-model-name", "m", "--max-model-len",
              str(args.long_prompt + 64), "--uvicorn-log-level", "warning"] + \
        (["--dtype", "float32"] if args.fp32 else [])  # "auto" would serve an fp32 checkpoint in bf16
    kv = lambda role: json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,  # noqa: E731
                                  "kv_connector_extra_config": {"shared_storage_path": str(work / "kv")}})
    gpu = lambda i: None if args.device == "cpu" else str(i)  # noqa: E731
    processes = []
    try:
        if name == "single":
            processes.append(start(["serve", *engine, "--port", "8301"], gpu(0), work / "single.log"))
            url = "http://127.0.0.1:8301"
            wait_ready(url, "/health")
        else:
            processes.append(start(["serve", *engine, "--port", "8302", "--kv-transfer-config", kv("kv_producer")],
                                   gpu(0), work / "prefill.log"))
            processes.append(start(["serve", *engine, "--port", "8303", "--kv-transfer-config", kv("kv_consumer")],
                                   gpu(1), work / "decode.log"))
            processes.append(start(["proxy", "--prefill", "http://127.0.0.1:8302", "--decode", "http://127.0.0.1:8303",
                                    "--port", "8304"], None, work / "proxy.log"))
            for port in (8302, 8303):
                wait_ready(f"http://127.0.0.1:{port}", "/health")
            url = "http://127.0.0.1:8304"
            wait_ready(url, "/v1/models")
        result = asyncio.run(workload(url, args))
        if name == "split":  # where the split's time goes: each side's KV-transfer gauges
            result["kv_transfer"] = {role: kv_transfer_gauges(f"http://127.0.0.1:{port}")
                                     for role, port in (("producer", 8302), ("consumer", 8303))}
        return result
    finally:
        for process in processes:
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a random ~1B Llama)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    parser.add_argument("--fp32", action="store_true",
                        help="the model in fp32: the long requests' texts must then match exactly (no bf16 near-ties)")
    parser.add_argument("--num-decodes", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--num-long", type=int, default=8)
    parser.add_argument("--long-prompt", type=int, default=2048)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()
    if args.small:
        args.num_decodes, args.decode_tokens, args.num_long, args.long_prompt = 2, 24, 2, 64
        args.interval = args.warmup = 0.2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or build_random_llama(work / "model", args.small, args.fp32)
        results = {name: run_setup(name, model, args, work) for name in ("single", "split")}
    # Correctness beside the timing: the long requests' greedy text, split against single (in
    # bf16 a prefill over loaded KV may still break a near-tie differently; the fraction says).
    pairs = list(zip(results["single"].pop("long_texts"), results["split"].pop("long_texts")))
    results["long_texts_equal"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    print(json.dumps(results, indent=2))
    print(f"long requests with the same text on both setups: {results['long_texts_equal']}")
    for name in ("single", "split"):
        r = results[name]
        print(f"{name:7} ITL p50 {r['itl_p50_ms']:8.1f} ms  p99 {r['itl_p99_ms']:8.1f} ms  "
              f"max {r['itl_max_ms']:8.1f} ms  | long prompts' TTFT {r['long_ttft_mean_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
