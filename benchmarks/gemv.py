"""The projections of a batch-1 decode step: cuBLAS (`F.linear`) against `kernels/gemv.py`.

For each weight shape of Qwen3-0.6B and of Llama-3-8B at TP=1 and TP=2, and for 1 and 8 rows
of x, the time of one `y = x W^T` inside a CUDA graph, as the engine runs it. The graph walks
through enough copies of W (>= 256 MB in all) that none is still in the L2 cache (50 MB on an
H200) when it is read again, as in a real step where 28+ layers' weights pass through.
Reported: µs per call and the bandwidth it implies (bytes of W / time), for cuBLAS and for
every `skinny_linear` config of the sweep; the best config per shape; the largest error
against cuBLAS.

    python benchmarks/gemv.py --out benchmarks/results/      # on a GPU -> gemv.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (N, K) of W
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048), "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072), "qwen3-0.6b lm_head": (151936, 1024),
    "llama-8b qkv": (6144, 4096), "llama-8b o": (4096, 4096), "llama-8b gate_up": (28672, 4096),
    "llama-8b down": (4096, 14336),
    "llama-8b tp2 qkv": (3072, 4096), "llama-8b tp2 o": (4096, 2048), "llama-8b tp2 gate_up": (14336, 4096),
    "llama-8b tp2 down": (4096, 7168),
}
ROWS = (1, 8)
CONFIGS = [(4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 4),
           (16, 512, 8), (32, 256, 8)]
L2_BUST_BYTES = 256 << 20
REPLAYS = 20


def time_us(fn_per_copy, copies: int) -> float:
    """µs per call: `copies` calls captured in one graph, replayed REPLAYS times."""
    for i in range(copies):
        fn_per_copy(i)  # compile / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_per_copy(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (REPLAYS * copies)


def measure_shape(n: int, k: int, rows: int) -> dict:
    from minivllm.kernels.gemv import skinny_linear

    weight_bytes = n * k * 2
    copies = max(2, math.ceil(L2_BUST_BYTES / weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out: dict = {"N": n, "K": k, "rows": rows, "weight_mb": round(weight_bytes / 2**20, 1)}
    us = time_us(lambda i: F.linear(x, weights[i]), copies)
    out["cublas"] = {"us": round(us, 2), "tb_s": round(weight_bytes / us / 1e6, 2)}
    ref = F.linear(x, weights[0]).float()
    for config in CONFIGS:
        name = "skinny %d/%d/%d" % config
        try:
            us = time_us(lambda i, c=config: skinny_linear(x, weights[i], None, c), copies)
            err = ((skinny_linear(x, weights[0], None, config).float() - ref).abs().max() / ref.abs().max()).item()
            out[name] = {"us": round(us, 2), "tb_s": round(weight_bytes / us / 1e6, 2), "rel_err": float(f"{err:.2e}")}
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
            out[name] = {"error": repr(e)[:200]}
    skinny = {key: v for key, v in out.items() if key.startswith("skinny") and "us" in v}
    best = min(skinny, key=lambda key: skinny[key]["us"])
    out["best"] = best
    out["best_over_cublas"] = round(out["cublas"]["us"] / skinny[best]["us"], 2)
    del weights
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = {}
    for rows in ROWS:
        for name, (n, k) in SHAPES.items():
            results[f"{name} x{rows}"] = r = measure_shape(n, k, rows)
            print(f"{name:24s} rows {rows}: cuBLAS {r['cublas']['us']:7.2f} us ({r['cublas']['tb_s']:.2f} TB/s), "
                  f"best {r['best']} {r[r['best']]['us']:7.2f} us ({r[r['best']]['tb_s']:.2f} TB/s), "
                  f"{r['best_over_cublas']}x", flush=True)
    totals = {}
    for key, r in results.items():
        per_config = {c: r[c]["us"] for c in r if c.startswith("skinny") and "us" in r[c]}
        for c, us in per_config.items():
            totals.setdefault(c, 0.0)
            totals[c] += us
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results,
              "sum_us_per_config": {c: round(v, 1) for c, v in sorted(totals.items(), key=lambda kv: kv[1])}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["sum_us_per_config"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
