"""Speculative decoding: latency per token with and without it, next to what theory expects.

For batch sizes 1, 8 and 64, greedy requests of `--max-tokens` tokens (EOS ignored) run on
the bundled tiny-shakespeare model (or `--model`) three ways:

    none     the target alone (CUDA graphs on a GPU)
    ngram    n-gram prompt lookup, k = --k, n in [1, 3]
    draft    the bundled tiny-shakespeare-draft (or `--draft`), k = --k

on two workloads:

    repeat   "edit a given text": the prompt is a passage the target wrote, followed by the
             passage's first 16 tokens again: a model that copies its context continues the
             passage, which n-gram lookup predicts (the tiny bundled model copies loosely but
             repeats its own phrases)
    free     a speaker's name ("ROMEO:"), the model writing freely (no repetition to exploit)

Reported per row: the decode latency per token (wall time of the decode steps / tokens per
sequence: what one user waits per token at that batch), the measured speedup over `none`, the
draft acceptance rate and system efficiency (the engine's own metrics, vLLM's names), alpha
(accepted / checked guesses: a guess after a rejection is never checked, which vLLM's
acceptance rate counts as rejected, so it understates the papers' alpha), and the speedup
theory expects (Leviathan et al. 2023, Theorem 3.8):

    expected = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))

with c = (the draft's time per token decoding alone at that batch) / (the target's); c = 0
for n-gram lookup (it runs on the host). The formula assumes the target's (k+1)-token
scoring pass costs what a one-token decode step costs, which holds while a step is bound by
reading the weights (small batches) and fails as the batch grows: that is where speculation
stops paying. Every speculative run's tokens are compared with `none`'s (greedy: identical
in fp32; `agreement` is the fraction of requests whose tokens match exactly).

    python benchmarks/spec_decode.py --out spec_decode.json            # GPU: all rows
    python benchmarks/spec_decode.py --shape llama-3-8b --self-draft --batch-sizes 1 --workloads repeat
    python benchmarks/spec_decode.py --batch-sizes 1 8 --rounds 8     # 8 rounds per schedule
    python benchmarks/spec_decode.py --device cpu --batch-sizes 1 --max-tokens 16   # smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from common import build_checkpoint
from minivllm import EngineArgs, LLMEngine, SamplingParams
from minivllm.spec_decode.metrics import expected_speedup

SPEAKERS = ["ROMEO:", "JULIET:", "KING HENRY:", "HAMLET:", "MENENIUS:", "GLOUCESTER:", "LADY MACBETH:",
            "PROSPERO:"]
PASSAGE_TOKENS = 160
REPEATED_PREFIX = 16  # the repeat workload's prompt ends with the passage's first tokens again
DRAFT = "tiny-shakespeare-draft"
SHAPE_MAX_MODEL_LEN = 2048  # a --shape model's context, within one prefill batch (no chunked prefill)


def make_engine(args, model: str | None, batch: int, **spec) -> LLMEngine:
    # A pool sized to the workload: a tiny model would otherwise get millions of blocks from
    # the memory profile, and the block manager would spend seconds creating them.
    tokens_per_seq = PASSAGE_TOKENS + REPEATED_PREFIX + 8 + args.max_tokens + args.k + 16
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, device=args.device, dtype=args.dtype, max_num_seqs=max(batch, 8), enforce_eager=args.enforce_eager,
        max_model_len=SHAPE_MAX_MODEL_LEN if args.shape else None,
        max_num_batched_tokens=max(2048, batch * (PASSAGE_TOKENS + REPEATED_PREFIX + 8)),
        num_gpu_blocks_override=2 * batch * -(-tokens_per_seq // 16) + 64, **spec))


def workload(kind: str, engine: LLMEngine, batch: int) -> list[list[int]]:
    """Token-id prompts: a speaker's name ("free"), or the name, a passage the target wrote
    (sampled at temperature 0.8, seed i: a different passage per request) and the passage's
    first tokens again ("repeat")."""
    names = [engine.tokenizer.encode(SPEAKERS[i % len(SPEAKERS)]) for i in range(batch)]
    if kind == "free":
        return names
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=PASSAGE_TOKENS, ignore_eos=True)
              for i in range(batch)]
    texts = generate(engine, names, params)[0]
    return [name + text + text[:REPEATED_PREFIX] for name, text in zip(names, texts)]


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """(token ids per request, seconds of the decode steps: every step after the first)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    results, first_step_end = {}, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[int(output.request_id)] = output.outputs[0].token_ids
        if first_step_end is None:
            _sync(engine)
            first_step_end = time.perf_counter()
    _sync(engine)
    return [results[i] for i in range(len(prompts))], time.perf_counter() - first_step_end


def _sync(engine: LLMEngine) -> None:
    if engine.device_config.device_type == "cuda":
        torch.cuda.synchronize()


def counts(engine: LLMEngine) -> dict:
    """The speculative worker's cumulative counts (`AcceptanceCounter`)."""
    counter = engine.model_executor.driver_worker.counter
    return {name: getattr(counter, name)
            for name in ("draft_tokens", "accepted_tokens", "emitted_tokens", "max_emitted_tokens", "checked_tokens")}


def spec_metrics(before: dict, after: dict) -> dict:
    """The acceptance metrics of the run between two `counts` (the warm-up excluded)."""
    delta = {name: after[name] - before[name] for name in after}
    return delta | {"draft_acceptance_rate": delta["accepted_tokens"] / max(delta["draft_tokens"], 1),
                    "system_efficiency": delta["emitted_tokens"] / max(delta["max_emitted_tokens"], 1),
                    "alpha": delta["accepted_tokens"] / max(delta["checked_tokens"], 1)}


def run_row(args, kind: str, batch: int, proposer: str, prompts, baseline) -> dict:
    spec = {"none": {}, "ngram": dict(speculative_model="[ngram]", num_speculative_tokens=args.k,
                                      ngram_prompt_lookup_max=3),
            "draft": dict(speculative_model=args.draft, num_speculative_tokens=args.k)}[proposer]
    if spec and args.rounds is not None:
        spec["num_scheduler_steps"] = args.rounds
    engine = make_engine(args, args.model, batch, **spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    generate(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    before = counts(engine) if spec else None
    tokens, seconds = generate(engine, prompts, params)
    row = {"workload": kind, "batch": batch, "proposer": proposer, "k": args.k if spec else 0,
           "ms_per_token": 1e3 * seconds / (args.max_tokens - 1), "tokens": tokens}
    if spec:
        row |= spec_metrics(before, counts(engine))
        row["agreement"] = sum(a == b for a, b in zip(tokens, baseline["tokens"])) / batch
    return row


def draft_cost_ratio(args, batch: int, prompts, target_ms: float) -> float:
    """c: the draft decoding alone at this batch, per token, over the target's."""
    engine = make_engine(args, args.draft, batch)
    generate(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    _, seconds = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                          ignore_eos=True))
    return 1e3 * seconds / (args.max_tokens - 1) / target_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="target (default: the bundled tiny-shakespeare)")
    p.add_argument("--draft", default=DRAFT, help="draft model (default: the bundled tiny-shakespeare-draft)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--workloads", nargs="+", default=["repeat", "free"], choices=["repeat", "free"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the models' dtype; float32 tells numerics from logic when "
                                                   "agreement with the baseline is below 1 (bf16 on a GPU)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the baseline or the draft")
    p.add_argument("--shape", default=None, help="target: a random-weight checkpoint of benchmarks/configs/SHAPE "
                                                 "(e.g. llama-3-8b) instead of --model")
    p.add_argument("--self-draft", action="store_true", help="the target is its own draft (acceptance 1: "
                                                            "what the mechanism itself costs)")
    p.add_argument("--rounds", type=int, default=None, help="speculative rounds per schedule "
                   "(num_scheduler_steps with speculation; default: the engine's)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.shape:
        device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
        args.model = str(build_checkpoint(args.shape, Path(tempfile.mkdtemp()), device))
    if args.self_draft:
        args.draft = args.model or "tiny-shakespeare"
    rows = []
    for kind in args.workloads:
        for batch in args.batch_sizes:
            prompts = workload(kind, make_engine(args, args.model, batch), batch)
            baseline = run_row(args, kind, batch, "none", prompts, None)
            c = draft_cost_ratio(args, batch, prompts, baseline["ms_per_token"])
            rows.append(baseline)
            for proposer in (["ngram", "draft"] if kind == "repeat" else ["draft"]):
                row = run_row(args, kind, batch, proposer, prompts, baseline)
                row["cost_ratio"] = 0.0 if proposer == "ngram" else c
                row["speedup"] = baseline["ms_per_token"] / row["ms_per_token"]
                row["expected_speedup"] = expected_speedup(row["alpha"], args.k, row["cost_ratio"])
                rows.append(row)
                print(format_row(row), flush=True)
    print(table(rows))
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
        meta = {"device": device, "torch": torch.__version__, "host": platform.node(), "k": args.k,
                "shape": args.shape, "self_draft": args.self_draft,
                "max_tokens": args.max_tokens, "enforce_eager": args.enforce_eager, "dtype": args.dtype,
                "rounds": args.rounds}
        args.out.write_text(json.dumps({"meta": meta, "rows": [{k: v for k, v in r.items() if k != "tokens"}
                                                                for r in rows]}, indent=2))


def format_row(row: dict) -> str:
    return (f"{row['workload']:6s} batch {row['batch']:3d} {row['proposer']:5s}: {row['ms_per_token']:.3f} ms/token, "
            f"acceptance {row['draft_acceptance_rate']:.3f} (alpha {row['alpha']:.3f}), speedup {row['speedup']:.2f}x "
            f"(expected {row['expected_speedup']:.2f}x, c = {row['cost_ratio']:.2f}), agreement {row['agreement']:.2f}")


def table(rows: list[dict]) -> str:
    lines = ["| workload | batch | proposer | ms / token | acceptance rate | alpha | efficiency | speedup | expected | c | agreement |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["proposer"] == "none":
            lines.append(f"| {r['workload']} | {r['batch']} | none | {r['ms_per_token']:.3f} | | | | 1.00× | | | |")
        else:
            lines.append(f"| {r['workload']} | {r['batch']} | {r['proposer']} (k={r['k']}) | {r['ms_per_token']:.3f} | "
                         f"{r['draft_acceptance_rate']:.3f} | {r['alpha']:.3f} | {r['system_efficiency']:.3f} | {r['speedup']:.2f}× | "
                         f"{r['expected_speedup']:.2f}× | {r['cost_ratio']:.2f} | {r['agreement']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
