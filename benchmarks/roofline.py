"""How close each phase of the headline run comes to the GPU's limits: a roofline.

    python benchmarks/roofline.py benchmarks/results/nano_vllm_workload_h100.json \
        --png docs/img/roofline_h100.png

Reads the headline row's timeline (`StepTimeline`: per phase its seconds, forward passes,
prompt and output tokens, and the KV tokens its decode steps read) and counts, from the model's
shape (`configs/qwen3-0.6b`), what each phase had to move and compute:

    decode   bytes = passes x weight bytes + KV tokens read x KV bytes per token
             FLOPs = output tokens x 2 x linear params + KV tokens read x attention FLOPs per pair
    prefill  bytes = passes x weight bytes + prompt tokens x KV bytes per token (the KV written)
             FLOPs = prompt tokens x 2 x linear params (lm_head: one row per prompt)
                     + sum of prompt_len^2 / 2 x attention FLOPs per pair (causal)

Weights in bf16; activations and the flash-style attention's re-reads are left out, so the
figures are lower bounds on the traffic. Peaks: NVIDIA's H100 SXM and H200 SXM datasheets
(HBM bandwidth; dense bf16 Tensor Core FLOP/s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import CONFIG_DIR, make_workload

PEAKS = {  # GPU name prefix: (HBM bytes/s, dense bf16 FLOP/s)
    "NVIDIA H100": (3.35e12, 989e12),
    "NVIDIA H200": (4.8e12, 989e12),
}
BF16_BYTES = 2


def model_costs(config: dict) -> dict:
    """Per-token costs of a Llama/Qwen3-shaped model (biases and norms left out)."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim  # qkv_proj
                 + heads * head_dim * hidden  # o_proj
                 + 3 * hidden * config["intermediate_size"])  # gate_up_proj, down_proj
    lm_head = hidden * vocab
    return {"linear_params": layers * per_layer + lm_head, "lm_head_params": lm_head,
            "weight_bytes": (layers * per_layer + lm_head) * BF16_BYTES,
            "kv_bytes_per_token": layers * 2 * kv_heads * head_dim * BF16_BYTES,
            "attn_flops_per_pair": layers * heads * head_dim * 4}  # QK^T and PV, 2 FLOPs a multiply-add


def phase_traffic(name: str, phase: dict, costs: dict, prompt_lens: list[int]) -> tuple[float, float]:
    """(bytes, FLOPs) one phase moved and computed."""
    passes = phase["forward_passes"]
    if name == "prefill steps":
        tokens = phase["prompt_tokens"]
        flops = (2 * tokens * (costs["linear_params"] - costs["lm_head_params"])
                 + 2 * len(prompt_lens) * costs["lm_head_params"]
                 + sum(p * p / 2 for p in prompt_lens) * costs["attn_flops_per_pair"])
        return passes * costs["weight_bytes"] + tokens * costs["kv_bytes_per_token"], flops
    reads = phase["kv_token_reads"]
    flops = 2 * phase["output_tokens"] * costs["linear_params"] + reads * costs["attn_flops_per_pair"]
    return passes * costs["weight_bytes"] + reads * costs["kv_bytes_per_token"], flops


def roofline_rows(report: dict, config: dict) -> list[dict]:
    gpu = report["environment"]["gpu"]
    bandwidth, flops_peak = next(v for k, v in PEAKS.items() if gpu.startswith(k))
    costs = model_costs(config)
    prompts, _ = make_workload()
    rows = []
    for name, phase in report["rows"]["headline"]["timeline"].items():
        moved, computed = phase_traffic(name, phase, costs, [len(p) for p in prompts])
        seconds = phase["seconds"]
        intensity = computed / moved
        attainable = min(flops_peak, intensity * bandwidth)
        rows.append({"phase": name, "seconds": seconds, "bytes_per_s": moved / seconds,
                     "flops_per_s": computed / seconds, "intensity": intensity,
                     "of_bandwidth": moved / seconds / bandwidth, "of_flops": computed / seconds / flops_peak,
                     "of_roofline": computed / seconds / attainable})
    return rows


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"{gpu}: achieved rate per phase of the headline run against the GPU's peaks", "",
             "| phase | seconds | TB/s (of peak) | TFLOP/s (of peak) | FLOP per byte | of the roofline |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['seconds']:.3f} | {r['bytes_per_s'] / 1e12:.2f} ({r['of_bandwidth']:.0%}) | "
                     f"{r['flops_per_s'] / 1e12:.0f} ({r['of_flops']:.0%}) | {r['intensity']:.0f} | "
                     f"{r['of_roofline']:.0%} |")
    return "\n".join(lines)


def plot(rows: list[dict], gpu: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidth, flops_peak = next(v for k, v in PEAKS.items() if gpu.startswith(k))
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=130)
    ridge = flops_peak / bandwidth
    xs = [1, ridge, 1e4]
    ax.plot(xs, [min(flops_peak, x * bandwidth) / 1e12 for x in xs], color="black", linewidth=1.5)
    ax.annotate(f"HBM {bandwidth / 1e12:.2f} TB/s", (3, 3 * bandwidth / 1e12 * 1.25), fontsize=8, rotation=33)
    ax.annotate(f"bf16 {flops_peak / 1e12:.0f} TFLOP/s", (ridge * 1.3, flops_peak / 1e12 * 1.12), fontsize=8)
    for r in rows:
        ax.scatter(r["intensity"], r["flops_per_s"] / 1e12, s=20 + 300 * r["seconds"] / max(x["seconds"] for x in rows))
        ax.annotate(f"{r['phase']} ({r['of_roofline']:.0%})", (r["intensity"], r["flops_per_s"] / 1e12),
                    xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte of HBM traffic)",
           ylabel="achieved TFLOP/s", title=f"The headline run's phases on one {gpu} (marker area: time)")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a nano_vllm_workload results JSON with the headline row")
    parser.add_argument("--config", type=Path, default=CONFIG_DIR / "qwen3-0.6b" / "config.json")
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    report = json.loads(args.result.read_text())
    rows = roofline_rows(report, json.loads(args.config.read_text()))
    gpu = report["environment"]["gpu"]
    print(markdown(rows, gpu))
    if args.png:
        plot(rows, gpu, args.png)


if __name__ == "__main__":
    main()
