"""Where the OpenAI server's throughput goes: the same workload through fewer layers.

nano-vllm's workload (256 requests, temperature 0.6, ignore_eos, its warm-up), default engine
arguments, on one GPU, through:

    offline MODE...   an `LLMEngine` stepped here, each request's outputs built per model step
                      as a stream needs them. MODE: final (FINAL_ONLY, what LLM.generate asks),
                      delta / cumulative (that output kind, built and dropped), delta-wire /
                      cumulative-wire (also encoded for the engine process's socket and
                      pickled), any of them with ":SECONDS" (requests arrive evenly over that
                      many seconds instead of all at once, as HTTP clients do).
    mq KIND...        the engine in its own process (`MQLLMEngineClient`, what `minivllm serve`
                      runs), 256 concurrent streams in one asyncio loop, no HTTP. KIND: delta or
                      cumulative.

Compare each figure with `final` (or benchmarks/nano_vllm_workload.py's headline) of the same run; the
gap between `mq delta` and `benchmarks/serving.py --workload` is the HTTP server and its clients.

    python benchmarks/nano_vllm_workload.py build --dir /tmp/ck --models qwen3-0.6b   # the checkpoint
    python benchmarks/serving_split.py /tmp/ck/qwen3-0.6b offline final delta-wire delta-wire:1.0
    python benchmarks/serving_split.py /tmp/ck/qwen3-0.6b mq delta cumulative

`--smoke` (first argument): 4 short requests in fp32 on the CPU, to check that it runs.
"""

from __future__ import annotations

import asyncio
import gc
import json
import pickle
import sys
import time

from common import NANO_MAX_MODEL_LEN, NANO_WARMUP_PROMPT, row_workload

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.multiprocessing.client import MQLLMEngineClient
from minivllm.engine.multiprocessing.deltas import OutputDeltaEncoder
from minivllm.sampling_params import RequestOutputKind, SamplingParams

KINDS = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
         "cumulative": RequestOutputKind.CUMULATIVE}


def params(max_tokens: int, kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def run_offline(engine: LLMEngine, mode: str, prompts, max_tokens) -> dict:
    name, _, ramp = mode.partition(":")
    kind, wire = KINDS[name.removesuffix("-wire")], name.endswith("-wire")
    encoder, ramp_s = OutputDeltaEncoder(), float(ramp or 0)
    pending = list(enumerate(zip(prompts, max_tokens)))

    def release(start: float) -> None:  # request i arrives at i / n of the ramp
        while pending and pending[0][0] * ramp_s / len(prompts) <= time.perf_counter() - start:
            i, (prompt, m) = pending.pop(0)
            engine.add_request(f"{mode}-{i}", {"prompt_token_ids": prompt}, params(m, kind))
            if kind == RequestOutputKind.DELTA:
                encoder.add_delta_request(f"{mode}-{i}")

    def consume(outputs) -> None:  # what the engine process does with each model step's outputs
        if wire:
            pickle.dumps([encoder.encode(o) for o in outputs])

    start = time.perf_counter()
    while engine.has_unfinished_requests() or pending:
        release(start)
        if engine.has_unfinished_requests():
            consume(engine.step(consume))
        else:
            time.sleep(0.001)
    elapsed = time.perf_counter() - start
    return {"mode": f"offline {mode}", "output_tokens_per_s": round(sum(max_tokens) / elapsed, 1),
            "elapsed_s": round(elapsed, 3)}


async def run_mq(client: MQLLMEngineClient, name: str, prompts, max_tokens, tag: str) -> dict:
    kind = KINDS[name]

    async def one(i: int, prompt: list[int], m: int) -> int:
        stream = await client.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params(m, kind))
        tokens = 0
        async for output in stream.generator():
            new = len(output.outputs[0].token_ids)
            tokens = tokens + new if kind == RequestOutputKind.DELTA else new
        return tokens

    warm = await client.add_request(f"{tag}-warm", NANO_WARMUP_PROMPT, params(64, kind))
    async for _ in warm.generator():
        pass
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))))
    elapsed = time.perf_counter() - start
    if counts != max_tokens:
        raise RuntimeError("a stream lost tokens")
    return {"mode": f"mq {name}", "output_tokens_per_s": round(sum(counts) / elapsed, 1), "elapsed_s": round(elapsed, 3)}


SMOKE = {"num_seqs": 4, "prompt_cap": 16, "max_tokens_cap": 6}


def main(argv: list[str]) -> None:
    smoke = argv[0] == "--smoke"
    ckpt, layer, modes = argv[smoke], argv[smoke + 1], argv[smoke + 2:]
    device = dict(dtype="float32", device="cpu") if smoke else dict(dtype="bfloat16")
    args = EngineArgs(model=ckpt, max_model_len=NANO_MAX_MODEL_LEN, **device)
    prompts, max_tokens = row_workload(SMOKE if smoke else {})
    if layer == "offline":
        engine = LLMEngine.from_engine_args(args)
        engine.add_request("warm", NANO_WARMUP_PROMPT, params(64, RequestOutputKind.CUMULATIVE))
        while engine.has_unfinished_requests():
            engine.step()
        gc.collect()
        gc.freeze()  # as the engine process does
        for mode in modes:
            print(json.dumps(run_offline(engine, mode, prompts, max_tokens)), flush=True)
        return
    client = MQLLMEngineClient.from_engine_args(args)
    try:
        for i, name in enumerate(modes):
            print(json.dumps(asyncio.run(run_mq(client, name, prompts, max_tokens, str(i)))), flush=True)
    finally:
        client.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
