"""What the Python around the GPU costs: `engine.step()` with the model replaced by a stand-in.

On a GPU the forward pass of a decode step runs asynchronously; everything else in
`LLMEngine.step()` — scheduling, building the flat batch, sampling bookkeeping, appending
tokens, stop checks, reporting — is host work, and with one step per schedule the GPU waits
for it. This benchmark measures that host work alone, on any machine: the model's forward
pass and LM head are replaced by stand-ins that do almost nothing (`[num_tokens, hidden]` hidden
states, `[rows, 16]` logits), so what is left is exactly the engine's own code.

For each batch size, B requests with 512-token prompts are prefilled, then decode steps are
timed (median of MEASURE_STEPS engine steps) with 1 and 8 scheduler steps, and with n-gram
speculation in 1 and 8 rounds per schedule. Reported: time per engine step, tokens per step
and per generated token of one sequence (step / (B x tokens per step)).
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
# Speculative rows: up to 8 rounds of k + 1 = 5 tokens per engine step, so fewer measured steps
# keep every sequence inside MAX_TOKENS.
SPEC_TOKENS, SPEC_BATCH_SIZES, SPEC_MEASURE_STEPS = 4, (1, 64), 8


class StandInModel(torch.nn.Module):
    """The model's interface with almost no work behind it: its greedy token after token t is
    t + 1 (mod STAND_IN_VOCAB), so its text cycles through the vocabulary and n-gram lookup
    guesses every token right."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden = torch.zeros(input_ids.shape[0], self.hidden_size)
        return hidden.scatter_(1, ((input_ids + 1) % STAND_IN_VOCAB).unsqueeze(1), 1.0)

    def compute_logits(self, hidden_states, upcast=True):
        return hidden_states[:, :STAND_IN_VOCAB]


def make_engine(batch: int, num_scheduler_steps: int, speculative: bool = False):
    """The bundled model's engine on the CPU, its model replaced by a stand-in (the runner's
    public `model` attribute: the runner calls `model(...)` and `model.compute_logits(...)`).
    speculative: n-gram speculation, k = SPEC_TOKENS (the stand-in's text cycles, so lookup
    guesses right and every guess is accepted: the host work of full rounds)."""
    from minivllm import EngineArgs, LLMEngine

    spec = dict(speculative_model="[ngram]", num_speculative_tokens=SPEC_TOKENS, ngram_prompt_lookup_max=3)
    engine = LLMEngine.from_engine_args(EngineArgs(
        device="cpu", max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
        num_gpu_blocks_override=batch * -(-(PROMPT_LEN + MAX_TOKENS + 16) // 16) + 16,
        num_scheduler_steps=num_scheduler_steps, **(spec if speculative else {}),
    ))
    runner = engine.model_executor.driver_worker.model_runner
    runner.model = StandInModel(engine.model_config.hf_config.hidden_size)
    return engine


def measure(batch: int, num_scheduler_steps: int, speculative: bool = False) -> dict:
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    engine = make_engine(batch, num_scheduler_steps, speculative)
    rng = random.Random(batch)
    # FINAL_ONLY, as LLM.generate asks: no RequestOutput per request per step.
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        prompt = [rng.randrange(4000) for _ in range(PROMPT_LEN)]
        if speculative:  # the stand-in's own cycle, so lookup finds k right guesses from the start
            prompt = [(i + j) % STAND_IN_VOCAB for j in range(PROMPT_LEN)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(g.is_prefill() for g in engine.scheduler.running):
        engine.step()
    engine.step()  # warm-up
    times, tokens = [], []
    for _ in range(SPEC_MEASURE_STEPS if speculative else MEASURE_STEPS):
        before = _output_tokens(engine)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        tokens.append(_output_tokens(engine) - before)
    step_ms = 1e3 * sorted(times)[len(times) // 2]
    tokens_per_step = sum(tokens) / len(tokens) / batch  # per sequence
    return {"batch": batch, "num_scheduler_steps": num_scheduler_steps, "speculative": speculative,
            "step_ms": round(step_ms, 3), "tokens_per_step": round(tokens_per_step, 2),
            "us_per_token_per_seq": round(1e3 * step_ms / (batch * tokens_per_step), 2)}


def _output_tokens(engine) -> int:
    return sum(seq.get_output_len() for group in engine.scheduler.running for seq in group.get_seqs())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the stand-ins are tiny: a second thread only adds waiting
    rows = [measure(batch, steps) for batch in BATCH_SIZES for steps in SCHEDULER_STEPS]
    rows += [measure(batch, steps, speculative=True) for batch in SPEC_BATCH_SIZES for steps in SCHEDULER_STEPS]
    print("| batch | scheduler steps (rounds) | speculation | engine step (ms) | tokens per step | "
          "per token per sequence (µs) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        spec = f"n-gram, k = {SPEC_TOKENS}" if r["speculative"] else "none"
        print(f"| {r['batch']} | {r['num_scheduler_steps']} | {spec} | {r['step_ms']} | {r['tokens_per_step']} | "
              f"{r['us_per_token_per_seq']} |")
    if args.out:
        report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                  "torch": torch.__version__, "prompt_len": PROMPT_LEN, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
