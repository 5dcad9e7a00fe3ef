"""What the Python around the GPU costs: `engine.step()` with the model replaced by a stand-in.

On a GPU the forward pass of a decode step runs asynchronously; everything else in
`LLMEngine.step()` — scheduling, building the flat batch, sampling bookkeeping, appending
tokens, stop checks, reporting — is host work, and with one step per schedule the GPU waits
for it. This benchmark measures that host work alone, on any machine: the model's forward
pass and LM head are replaced by stand-ins returning zeros (`[num_tokens, hidden]` hidden
states, `[rows, 16]` logits), so what is left is exactly the engine's own code.

For each batch size, B requests with 512-token prompts are prefilled, then decode steps are
timed (median of MEASURE_STEPS engine steps) with 1 and 8 scheduler steps. Reported: time
per engine step and per generated token of one sequence (step / (B x tokens per step)).
With 8 steps most of this also overlaps the GPU on a real device (see docs/architecture.md).

    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

BATCH_SIZES = (1, 64, 256)
SCHEDULER_STEPS = (1, 8)
PROMPT_LEN, MAX_TOKENS, MEASURE_STEPS = 512, 400, 15
STAND_IN_VOCAB = 16


class StandInModel(torch.nn.Module):
    """The model's interface with no work behind it: zero hidden states, zero logits."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return torch.zeros(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden_states, upcast=True):
        return torch.zeros(hidden_states.shape[0], STAND_IN_VOCAB)


def make_engine(batch: int, num_scheduler_steps: int):
    """The bundled model's engine on the CPU, its model replaced by a stand-in (the runner's
    public `model` attribute: the runner calls `model(...)` and `model.compute_logits(...)`)."""
    from minivllm import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        device="cpu", max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
        num_gpu_blocks_override=batch * -(-(PROMPT_LEN + MAX_TOKENS + 16) // 16) + 16,
        num_scheduler_steps=num_scheduler_steps,
    ))
    runner = engine.model_executor.driver_worker.model_runner
    runner.model = StandInModel(engine.model_config.hf_config.hidden_size)
    return engine


def measure(batch: int, num_scheduler_steps: int) -> dict:
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    engine = make_engine(batch, num_scheduler_steps)
    rng = random.Random(batch)
    # FINAL_ONLY, as LLM.generate asks: no RequestOutput per request per step.
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(4000) for _ in range(PROMPT_LEN)]}, params)
    while engine.scheduler.waiting or any(g.is_prefill() for g in engine.scheduler.running):
        engine.step()
    engine.step()  # warm-up
    times = []
    for _ in range(MEASURE_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step_ms = 1e3 * sorted(times)[len(times) // 2]
    return {"batch": batch, "num_scheduler_steps": num_scheduler_steps, "step_ms": round(step_ms, 3),
            "us_per_token_per_seq": round(1e3 * step_ms / (batch * num_scheduler_steps), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the stand-ins are tiny: a second thread only adds waiting
    rows = [measure(batch, steps) for batch in BATCH_SIZES for steps in SCHEDULER_STEPS]
    print("| batch | scheduler steps | engine step (ms) | per token per sequence (µs) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['num_scheduler_steps']} | {r['step_ms']} | {r['us_per_token_per_seq']} |")
    if args.out:
        report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                  "torch": torch.__version__, "prompt_len": PROMPT_LEN, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
