"""Decode-attention bandwidth: minivllm's Triton PagedAttention against PyTorch's options.

Decode attention reads every cached key and value once and does ~2 flops per byte, so its
speed is a bandwidth: KV bytes read / time. We compare, on the Qwen3-0.6B layer shape
(16 query heads, 8 KV heads, head dim 128, bf16, block size 16), at batch x context
1x4096, 8x4096, 64x4096, 256x1024, 8x32768:

  triton (auto)      minivllm.kernels paged_attention_decode, v1/v2 chosen automatically
  triton v1          the same, forced to one pass (num_kv_splits=1): why split-KV exists
  sdpa contiguous    torch SDPA (flash backend) on contiguous, unpaged K/V: the non-paged bar
  gather + sdpa      copy K/V out of the paged cache through the block table, then SDPA
  flex paged         FlexAttention with torch's experimental PagedAttention page table
  copy roofline      a large device-to-device copy, (bytes read + written) / time

Run on a GPU:  python benchmarks/kernels.py --out benchmarks/results/   (--sweep to tune, --profile)
It prints a markdown table, and writes kernels_<gpu>.json and kernels_<gpu>.png into --out.
`python benchmarks/kernels.py --plot-only benchmarks/results/kernels_h100.json --png docs/img/kernels_bandwidth_h100.png`
redraws the figure from saved numbers (no GPU needed).

`--prefill` times prefill attention instead: minivllm's paged prefill Triton kernel
(`get_ops("triton").paged_prefill_attention`, K/V read through a block table) against torch
SDPA with the flash backend on contiguous K/V, causal, at 1 x 8192 and 16 x 1024 tokens, same
head shape, bf16; CUDA events, median of PREFILL_REPS after warm-up. It writes
prefill_attention_<gpu>.json. `--prefill --smoke` runs tiny shapes on the CPU (Triton interpreter).

`--latency-sweep` tunes the split-KV kernel where latency, not bandwidth, decides: few
sequences of short context, with block tables as wide as an engine's (max_model_len / 16). The
time per launch of 28 launches (one per layer of the Qwen3-0.6B shape, each over its own blocks)
captured in one CUDA graph, per launch config. It writes kernels_latency_<gpu>.json.

`--batch-order` times the decode kernel on the running set of nano-vllm's workload (bench.py's
256 requests) after `t` decode steps, the batch in arrival order and longest first (the
scheduler's order), µs per launch of 28 in one CUDA graph. It writes
kernels_batch_order_<gpu>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, cuda_median_ms, gpu_tag, make_workload

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16  # Qwen3-0.6B attention layer
DTYPE = torch.bfloat16
DEVICE = "cuda"
SHAPES = [(1, 4096), (8, 4096), (64, 4096), (256, 1024), (8, 32768)]  # (batch, context)
TARGETS_TBPS = {(1, 4096): 1.2, (64, 4096): 2.8, (256, 1024): 2.8, (8, 32768): 2.6}  # on an H100
COPY_BYTES = 1 << 30  # the roofline copy: 1 GiB, far larger than L2
WARMUP_ROUNDS = 3
METHODS = ["triton (auto)", "triton v1", "sdpa contiguous", "gather + sdpa", "flex paged"]
# Tuning sweep: (tile tokens, num_warps, num_stages) of the decode kernel, and forced splits.
SWEEP_CONFIGS = [(16, 2, 3), (32, 4, 3), (32, 4, 2), (64, 4, 3), (64, 4, 2), (64, 8, 3), (128, 8, 2)]
SWEEP_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]
# Latency sweep: (batch, context, max_context = block-table width x 16) and split-KV configs.
LATENCY_SHAPES = [(1, 128, 1024), (1, 640, 1024), (1, 2048, 4096), (2, 640, 1024), (4, 640, 1024),
                  (4, 2048, 4096), (8, 1024, 4096), (16, 1024, 4096)]
LATENCY_CONFIGS = [(32, 4, 3), (32, 2, 3), (32, 2, 2), (16, 2, 2), (32, 1, 2), (64, 4, 2)]
LATENCY_LAYERS = 28
# Batch order: decode steps after which the running set is timed (all prompts prefilled at t=0).
ORDER_STEPS = [50, 200, 400, 600, 750, 850, 950]


def kv_bytes(batch: int, context: int) -> int:
    """Bytes of keys + values a decode step must read: the numerator of every bandwidth here."""
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def bench_ms(fn, cuda_graph: bool = True) -> float:
    """Median GPU time of fn() in ms, L2 flushed before every run (do_bench does that).

    cuda_graph=True times a CUDA-graph replay of fn, as an engine runs decode (vLLM captures
    its decode steps in graphs): the GPU work is the same, the Python launch overhead is gone.
    That overhead (~10-20 us per call here) would otherwise dominate the small shapes.
    fn must have been run once already (compiled, warmed up) before capture.
    """
    import triton.testing

    if cuda_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    else:
        run = fn
    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


def make_inputs(batch: int, context: int, seed: int = 0) -> dict:
    """A paged cache holding `batch` sequences of `context` tokens in scattered blocks."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE,
                           dtype=DTYPE, generator=gen)
    # A random permutation: consecutive tokens of a sequence live in unrelated blocks.
    block_tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).view(batch, blocks_per_seq).int()
    return dict(
        key_cache=kv_cache[0], value_cache=kv_cache[1], block_tables=block_tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        query=torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen),
        scale=HEAD_DIM**-0.5,
    )


# ------------------------------------------------------------------------------------------
# The contenders. Each returns a zero-argument function producing out [batch, heads, head_dim].
# ------------------------------------------------------------------------------------------
def triton_paged(x: dict, num_kv_splits: int | None = None):
    from minivllm.kernels.paged_attention import paged_attention_decode

    args = (x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"], x["scale"])
    return lambda: paged_attention_decode(*args, num_kv_splits=num_kv_splits)


def _gather(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V through the block table into contiguous [batch, kv_heads, context, head_dim]."""
    batch = x["block_tables"].shape[0]
    keys = x["key_cache"][x["block_tables"]].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)
    values = x["value_cache"][x["block_tables"]].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)
    return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def _sdpa(q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # flash decoding path of PyTorch
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)  # [batch, heads, 1, head_dim]
    return out.squeeze(2)


def sdpa_contiguous(x: dict):
    keys, values = _gather(x)  # done once, outside the timed function: an unpaged cache
    return lambda: _sdpa(x["query"], keys, values, x["scale"])


def gather_sdpa(x: dict):
    def run():
        keys, values = _gather(x)
        return _sdpa(x["query"], keys, values, x["scale"])

    return run


def flex_paged(x: dict):
    """FlexAttention over the paged cache, with torch's experimental PagedAttention helper.

    Flex wants the cache as one long [1, kv_heads, num_blocks * block_size, head_dim] sequence
    (its own layout, built once here, outside the timing); the page table maps each
    sequence's logical blocks to physical ones, and the block mask is converted to match.
    """
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, blocks_per_seq = x["block_tables"].shape
    num_blocks = x["key_cache"].shape[0]
    paged = PagedAttention(num_blocks, BLOCK_SIZE, batch, device=DEVICE)
    tables = x["block_tables"].long()
    paged.page_table[:, :blocks_per_seq] = tables
    rows = torch.arange(batch, device=DEVICE)[:, None].expand_as(tables)
    paged.physical_to_logical[rows, tables] = torch.arange(blocks_per_seq, device=DEVICE).expand_as(tables)
    paged.capacity[:] = blocks_per_seq * BLOCK_SIZE
    paged.empty_pages = []

    def as_flex_layout(cache):
        return cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0).contiguous()

    keys, values = as_flex_layout(x["key_cache"]), as_flex_layout(x["value_cache"])
    context = blocks_per_seq * BLOCK_SIZE
    logical = create_block_mask(lambda b, h, q, kv: kv >= 0, batch, None, 1, context,
                                device=DEVICE, BLOCK_SIZE=BLOCK_SIZE)
    physical = paged.convert_logical_block_mask(logical, kv_len=x["seq_lens"].long())
    flex = torch.compile(flex_attention, fullgraph=True)
    q = x["query"].unsqueeze(2)  # [batch, heads, 1, head_dim]
    options = {}

    def run():
        return flex(q, keys, values, block_mask=physical, scale=x["scale"], enable_gqa=True,
                    kernel_options=options or None).squeeze(2)

    try:
        run()
    except Exception:  # its default tiles may not divide our 16-token pages: use 16-token tiles
        options.update(BLOCK_M=16, BLOCK_N=16)
        torch._dynamo.reset()
        run()
    return run


CONTENDERS = {
    "triton (auto)": triton_paged,
    "triton v1": lambda x: triton_paged(x, num_kv_splits=1),
    "sdpa contiguous": sdpa_contiguous,
    "gather + sdpa": gather_sdpa,
    "flex paged": flex_paged,
}


def copy_bandwidth_tbps() -> float:
    """The roofline: a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(COPY_BYTES // 2, device=DEVICE, dtype=DTYPE)
    dst = torch.empty_like(src)
    # An idle GPU starts at low clocks: the first measurement of a fresh machine read 2.4 TB/s
    # instead of 3.0. Keep the best of a few, so the ceiling is not an artefact of warm-up.
    ms = min(bench_ms(lambda: dst.copy_(src), cuda_graph=False) for _ in range(WARMUP_ROUNDS))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e12


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_main(shapes, methods) -> list[dict]:
    rows = []
    for batch, context in shapes:
        x = make_inputs(batch, context)
        expected = sdpa_contiguous(x)()  # PyTorch's flash kernel is the correctness yardstick
        for method in methods:
            row = dict(batch=batch, context=context, method=method)
            try:
                start = time.perf_counter()
                fn = CONTENDERS[method](x)
                row["rel_err_vs_sdpa"] = rel_error(fn(), expected)  # also compiles / warms up
                row["ms_eager"] = bench_ms(fn, cuda_graph=False)
                row["tbps_eager"] = kv_bytes(batch, context) / (row["ms_eager"] * 1e-3) / 1e12
                try:
                    row["ms"] = bench_ms(fn)
                except Exception as error:  # not capturable in a CUDA graph: keep the eager time
                    row["graph_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    row["ms"] = row["ms_eager"]
                row["tbps"] = kv_bytes(batch, context) / (row["ms"] * 1e-3) / 1e12
                row["setup_s"] = time.perf_counter() - start
            except Exception as error:  # a contender that cannot run here is reported, not fatal
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def decode_config(config: tuple[int, int, int] | None):
    """Temporarily give v1 and v2 the launch config (tile tokens, num_warps, num_stages)."""
    from minivllm.kernels import paged_attention as pa

    saved = (pa.V1_CONFIG, pa.V2_CONFIG)
    if config is not None:
        pa.V1_CONFIG = pa.V2_CONFIG = config
    try:
        yield
    finally:
        pa.V1_CONFIG, pa.V2_CONFIG = saved


def run_sweep(shapes) -> list[dict]:
    """Kernel configs (auto splits) and forced split counts (default config), per shape."""
    rows = []
    for batch, context in shapes:
        x = make_inputs(batch, context)
        expected = sdpa_contiguous(x)()
        trials = [(cfg, None) for cfg in SWEEP_CONFIGS]
        # Split counts with the default configs (None: v1's for 1 split, v2's otherwise).
        trials += [(None, s) for s in SWEEP_SPLITS if s * 32 <= context]
        for config, splits in trials:
            with decode_config(config):
                fn = triton_paged(x, num_kv_splits=splits)
                err = rel_error(fn(), expected)
                ms = bench_ms(fn)
            tile, warps, stages = config or ("default",) * 3
            row = dict(batch=batch, context=context, tile=tile, warps=warps, stages=stages,
                       splits=splits, ms=ms, tbps=kv_bytes(batch, context) / (ms * 1e-3) / 1e12,
                       rel_err_vs_sdpa=err)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def run_latency_sweep(out: Path) -> list[dict]:
    """Split-KV configs at LATENCY_SHAPES: µs per launch, LATENCY_LAYERS launches in one graph,
    each layer's block table a different random draw from one large cache (cold in L2)."""
    import triton.testing

    from minivllm.kernels import paged_attention as pa

    num_blocks = 60_000  # 1.9 GB of K/V: far past L2
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    rows = []
    for batch, context, max_context in LATENCY_SHAPES:
        layers = [(torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen),
                   torch.randint(0, num_blocks, (batch, max_context // BLOCK_SIZE), device=DEVICE,
                                 dtype=torch.int32, generator=gen)) for _ in range(LATENCY_LAYERS)]
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        expected = None
        for config in LATENCY_CONFIGS:
            with decode_config(config):
                def run():
                    return [pa.paged_attention_decode(q, cache[0], cache[1], table, seq_lens, HEAD_DIM**-0.5)
                            for q, table in layers]
                out_first = run()[0]
                expected = out_first if expected is None else expected
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                us = triton.testing.do_bench(graph.replay, warmup=30, rep=200, return_mode="median") * 1e3
            row = dict(batch=batch, context=context, max_context=max_context, tile=config[0], warps=config[1],
                       stages=config[2], us_per_launch=round(us / LATENCY_LAYERS, 2),
                       splits=pa.choose_num_kv_splits(batch, NUM_KV_HEADS, max_context, pa._num_sms(seq_lens.device)),
                       rel_err_vs_first=rel_error(out_first, expected))
            print(json.dumps(row), flush=True)
            rows.append(row)
    path = out / f"kernels_latency_{gpu_tag(torch.cuda.get_device_name())}.json"
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                    layers=LATENCY_LAYERS, rows=rows), indent=1))
    return rows


def run_batch_order(out: Path) -> list[dict]:
    """The decode kernel over bench.py's running set after each of ORDER_STEPS decode steps,
    rows in arrival order and longest first: µs per launch (28 launches in one graph)."""
    import triton.testing

    from minivllm.kernels import paged_attention as pa

    prompts, max_tokens = make_workload()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    num_blocks = sum(len(p) + m for p, m in zip(prompts, max_tokens)) // BLOCK_SIZE + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    rows = []
    for step in ORDER_STEPS:
        lens = [len(p) + step for p, m in zip(prompts, max_tokens) if m > step]
        query = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
        tables = torch.randint(0, num_blocks, (len(lens), 4096 // BLOCK_SIZE), device=DEVICE, dtype=torch.int32,
                               generator=gen)  # as wide as the engine's (max_model_len 4096)
        row = dict(step=step, batch=len(lens), kv_mb=round(kv_bytes(1, sum(lens)) / 1e6, 1))
        for order in ("arrival", "longest first"):
            picked = range(len(lens)) if order == "arrival" else sorted(range(len(lens)), key=lambda i: -lens[i])
            pick = torch.tensor(list(picked), device=DEVICE)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)[pick]
            args = (query[pick], cache[0], cache[1], tables[pick], seq_lens, HEAD_DIM**-0.5)
            pa.paged_attention_decode(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(LATENCY_LAYERS):
                    pa.paged_attention_decode(*args)
            row[order] = round(triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / LATENCY_LAYERS, 1)
        row["speed-up"] = round(row["arrival"] / row["longest first"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    path = out / f"kernels_batch_order_{gpu_tag(torch.cuda.get_device_name())}.json"
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))
    return rows


def profile_kernels(shapes) -> list[dict]:
    """Device time of each GPU kernel in one call of triton (auto) and sdpa, via torch.profiler.

    Separates what the GPU spends (per kernel) from launch gaps and Python overhead.
    """
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for batch, context in shapes:
        x = make_inputs(batch, context)
        for method in ["triton (auto)", "sdpa contiguous"]:
            fn = CONTENDERS[method](x)
            fn()
            torch.cuda.synchronize()
            repeats = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(repeats):
                    fn()
                torch.cuda.synchronize()
            kernels = {e.key: e.device_time_total / repeats for e in prof.key_averages()
                       if e.device_time_total > 0}
            row = dict(batch=batch, context=context, method=method, kernels_us=kernels)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def markdown_table(rows: list[dict], copy_tbps: float, key: str = "tbps") -> str:
    """Shapes down, methods across, TB/s in the cells (key: "tbps" graph, "tbps_eager")."""
    head = "| batch x context | KV MB | " + " | ".join(METHODS) + " | target |"
    lines = [head, "|" + " --- |" * (len(METHODS) + 3)]
    for batch, context in sorted({(r["batch"], r["context"]) for r in rows}, key=SHAPES.index):
        cells = []
        for method in METHODS:
            match = [r for r in rows if (r["batch"], r["context"], r["method"]) == (batch, context, method)]
            cells.append("failed" if not match or key not in match[0] else f"{match[0][key]:.2f}")
        target = TARGETS_TBPS.get((batch, context))
        lines.append(f"| {batch} x {context} | {kv_bytes(batch, context) / 1e6:.0f} | " + " | ".join(cells)
                     + f" | {'>= %.1f' % target if target else '-'} |")
    lines.append(f"\nDevice copy roofline: {copy_tbps:.2f} TB/s (bytes read + written).")
    return "\n".join(lines)


def plot(results: dict, png: Path) -> None:
    """Grouped bars (TB/s per method per shape), the copy roofline, and the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.viz.style import COLORS, REQUEST_PALETTE

    rows, shapes = results["rows"], [tuple(s) for s in results["shapes"]]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(METHODS)
    for m, method in enumerate(METHODS):
        values = []
        for batch, context in shapes:
            match = [r for r in rows if (r["batch"], r["context"], r["method"]) == (batch, context, method)]
            values.append(match[0].get("tbps", 0.0) if match else 0.0)
        xs = [i + (m - (len(METHODS) - 1) / 2) * width for i in range(len(shapes))]
        _ = ax.bar(xs, values, width, label=method, color=REQUEST_PALETTE[m])
    _ = ax.axhline(results["copy_tbps"], color=COLORS["edge"], linestyle="--",
                   label=f"device copy {results['copy_tbps']:.2f} TB/s")
    for i, shape in enumerate(shapes):
        if shape in TARGETS_TBPS:
            _ = ax.plot([i - 0.4, i + 0.4], [TARGETS_TBPS[shape]] * 2, color=COLORS["copied"], linewidth=2,
                        label="target" if i == 0 else None)
    ax.set_xticks(range(len(shapes)), [f"{b} x {c}" for b, c in shapes])
    ax.set_xlabel("batch x context (Qwen3-0.6B layer: 16 q heads, 8 KV heads, d=128, bf16, block 16)")
    ax.set_ylabel("KV bytes read / time (TB/s)")
    ax.set_title(f"Decode attention bandwidth on {results['device']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- prefill attention
PREFILL_SHAPES = [(1, 8192), (16, 1024)]  # (sequences, tokens each): a fresh prompt, no cached context
PREFILL_SMOKE_SHAPES = [(1, 64), (2, 32)]
PREFILL_WARMUP, PREFILL_REPS = 5, 20


def prefill_inputs(batch: int, seq_len: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """The same tokens twice: packed for the paged kernel (K/V scattered over cache blocks through
    a permuted block table, as reshape_and_cache leaves them) and contiguous for SDPA."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_tokens = batch * seq_len
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks_per_seq).int()
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    pos = torch.arange(seq_len, device=device)
    for b in range(batch):  # token t of sequence b lives in block_tables[b, t // BLOCK_SIZE], slot t % BLOCK_SIZE
        blocks = block_tables[b, pos // BLOCK_SIZE].long()
        key_cache[blocks, pos % BLOCK_SIZE] = k[b * seq_len:(b + 1) * seq_len]
        value_cache[blocks, pos % BLOCK_SIZE] = v[b * seq_len:(b + 1) * seq_len]
    start_loc = torch.arange(0, num_tokens + 1, seq_len, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq_len, device=device, dtype=torch.int32)
    # SDPA's layout: [batch, heads, tokens, head_dim], contiguous.
    to_sdpa = lambda x: x.view(batch, seq_len, x.shape[1], HEAD_DIM).transpose(1, 2).contiguous()  # noqa: E731
    return dict(query=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                query_start_loc=start_loc, seq_lens=seq_lens,
                q_sdpa=to_sdpa(q), k_sdpa=to_sdpa(k), v_sdpa=to_sdpa(v))


def _sdpa_flash(device: str, inputs: dict):
    """A closure running SDPA causal on contiguous K/V: the flash backend on CUDA (GQA natively
    if this torch allows it, else K/V expanded to every query head beforehand, untimed)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if device.startswith("cuda") else SDPBackend.MATH
    q, k, v = inputs["q_sdpa"], inputs["k_sdpa"], inputs["v_sdpa"]

    def gqa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        gqa()
        return gqa, "native GQA"
    except RuntimeError:
        group = NUM_HEADS // NUM_KV_HEADS
        k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def expanded():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k_full, v_full, is_causal=True)

        return expanded, "K/V expanded to 16 heads (untimed)"


def _median_ms(fn, device: str, warmup: int, reps: int) -> float:
    """Median ms of `fn` after `warmup` calls (CUDA events on a GPU, wall time on a CPU)."""

    for _ in range(warmup):
        fn()
    return cuda_median_ms(fn, reps)


def bench_prefill(batch: int, seq_len: int, device: str, warmup: int, reps: int) -> dict:
    """ms of paged prefill (Triton) and SDPA flash on one shape, their ratio and their agreement."""
    from minivllm.kernels import get_ops

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    x = prefill_inputs(batch, seq_len, device, dtype)
    scale = HEAD_DIM ** -0.5
    paged_op = get_ops("triton").paged_prefill_attention

    def paged():
        return paged_op(x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["query_start_loc"],
                        x["seq_lens"], scale)

    sdpa, sdpa_note = _sdpa_flash(device, x)
    # Same numbers? SDPA's [batch, heads, tokens, dim] back to the kernel's [tokens, heads, dim].
    ref = sdpa().transpose(1, 2).reshape(batch * seq_len, NUM_HEADS, HEAD_DIM).float()
    err = ((paged().float() - ref).norm() / ref.norm()).item()
    paged_ms = _median_ms(paged, device, warmup, reps)
    sdpa_ms = _median_ms(sdpa, device, warmup, reps)
    flops = 4 * batch * seq_len * seq_len / 2 * NUM_HEADS * HEAD_DIM  # QK^T and PV, causal half
    return {"batch": batch, "seq_len": seq_len, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": str(dtype).removeprefix("torch."),
            "paged_triton_ms": round(paged_ms, 4), "sdpa_flash_ms": round(sdpa_ms, 4),
            "paged_speed_vs_sdpa": round(sdpa_ms / paged_ms, 3), "target_speed_vs_sdpa": 0.8,
            "paged_tflops": round(flops / paged_ms / 1e9, 1), "sdpa_tflops": round(flops / sdpa_ms / 1e9, 1),
            "sdpa_gqa": sdpa_note, "relative_error_vs_sdpa": float(f"{err:.3g}"),
            "timing": f"CUDA events, median of {reps} after {warmup} warm-up calls" if device.startswith("cuda")
            else f"wall clock, median of {reps} (CPU smoke: meaningless as speed)"}


def run_prefill(out: Path, smoke: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    shapes = PREFILL_SMOKE_SHAPES if smoke else PREFILL_SHAPES
    warmup, reps = (1, 3) if smoke else (PREFILL_WARMUP, PREFILL_REPS)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "rows": []}
    for batch, seq_len in shapes:
        row = bench_prefill(batch, seq_len, device, warmup, reps)
        results["rows"].append(row)
        (out / f"prefill_attention_{gpu_tag(results['device'])}.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(row), flush=True)
    print("| shape | paged Triton (ms) | SDPA flash (ms) | paged speed vs SDPA (target >= 0.8) |\n| --- | --- | --- | --- |")
    for r in results["rows"]:
        print(f"| {r['batch']} x {r['seq_len']} | {r['paged_triton_ms']} | {r['sdpa_flash_ms']} | "
              f"{r['paged_speed_vs_sdpa']:.2f}x |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel configs and split counts")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (slow to compile)")
    parser.add_argument("--profile", action="store_true", help="also list per-kernel device times")
    parser.add_argument("--plot-only", type=Path, help="redraw the figure from a saved kernels.json")
    parser.add_argument("--png", type=Path, help="where to write the figure (default: OUT/kernels_<gpu>.png)")
    parser.add_argument("--prefill", action="store_true", help="prefill attention vs SDPA flash only")
    parser.add_argument("--smoke", action="store_true", help="with --prefill: tiny shapes, CPU is fine")
    parser.add_argument("--latency-sweep", action="store_true",
                        help="split-KV launch configs at few short sequences only (µs per launch)")
    parser.add_argument("--batch-order", action="store_true",
                        help="the decode kernel on bench.py's running set, arrival order vs longest first")
    args = parser.parse_args()
    if args.prefill:
        if args.smoke and not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before minivllm.kernels imports triton
        run_prefill(args.out, smoke=args.smoke)
        return
    if args.plot_only:
        results = json.loads(args.plot_only.read_text())
        plot(results, args.png or args.plot_only.with_suffix(".png"))
        print(markdown_table(results["rows"], results["copy_tbps"]))
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    if args.latency_sweep or args.batch_order:
        args.out.mkdir(parents=True, exist_ok=True)
        (run_latency_sweep if args.latency_sweep else run_batch_order)(args.out)
        return
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernels_{gpu_tag(torch.cuda.get_device_name())}"
    png = args.png or stem.with_suffix(".png")
    results = dict(
        device=torch.cuda.get_device_name(), num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        shapes=SHAPES, copy_tbps=copy_bandwidth_tbps(), rows=[],
    )
    print(f"copy roofline {results['copy_tbps']:.2f} TB/s on {results['device']}", flush=True)

    def save():  # after every phase, so a run cut short still leaves its numbers
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
        plot(results, png)

    # FlexAttention compiles for minutes: it goes last, after the numbers that matter most.
    results["rows"] += run_main(SHAPES, [m for m in METHODS if m != "flex paged"])
    save()
    if args.sweep:
        results["sweep"] = run_sweep(SHAPES)
        save()
    if args.profile:
        results["profile"] = profile_kernels(SHAPES)
        save()
    if not args.no_flex:
        results["rows"] += run_main(SHAPES, ["flex paged"])
        save()
    print("CUDA-graph replays:\n" + markdown_table(results["rows"], results["copy_tbps"]))
    print("\nEager calls:\n" + markdown_table(results["rows"], results["copy_tbps"], key="tbps_eager"))
    for batch, context in SHAPES if args.sweep else []:
        best = max((r for r in results["sweep"] if (r["batch"], r["context"]) == (batch, context)),
                   key=lambda r: r["tbps"])
        print(f"best {batch}x{context}: {best['tbps']:.2f} TB/s  tile={best['tile']} warps={best['warps']} "
              f"stages={best['stages']} splits={best['splits']}")


if __name__ == "__main__":
    main()
