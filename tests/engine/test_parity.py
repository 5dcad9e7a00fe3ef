"""Greedy outputs token-identical to transformers' `generate`, under every engine mode.

The reference is transformers' own model and decoding loop (fp32, CPU, `do_sample=False`,
EOS ignored) on small random checkpoints; minivllm loads the same saved weights. After each
run every KV block must be free again.
"""

import random

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import Stats
from minivllm.sampling_params import SamplingParams
from minivllm.viz.snapshot import SnapshotRecorder

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from engine_test_checkpoints import assert_all_blocks_free, mixed_prompts

MAX_TOKENS = 12


class StatsCollector:
    def __init__(self):
        self.stats: list[Stats] = []

    def log(self, stats: Stats) -> None:
        self.stats.append(stats)


def run_all(engine: LLMEngine, prompts, params: SamplingParams, stagger: int = 0) -> dict[str, list[int]]:
    """Add the prompts (optionally one every `stagger` steps) and step until all finish."""
    pending = [(str(i), {"prompt_token_ids": p}) for i, p in enumerate(prompts)]
    results: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for request_id, prompt in batch:
                engine.add_request(request_id, prompt, params)
            pending = pending[len(batch):]
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        step += 1
    return results


# device="cpu": the reference is transformers in fp32 on the CPU (on a GPU, "auto" would pick
# bf16, and tokens may legitimately differ); tests/engine/test_engine_gpu.py covers the GPU.
def check_parity(checkpoint_dirs, family: str, prompts, stagger: int = 0, max_tokens: int = MAX_TOKENS,
                 **engine_kwargs) -> LLMEngine:
    path, hf_model = checkpoint_dirs[family]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", **engine_kwargs))
    collector = StatsCollector()
    engine.add_logger("collector", collector)
    engine.collector = collector
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = run_all(engine, prompts, params, stagger)
    for i, prompt in enumerate(prompts):
        assert results[str(i)] == checkpoints.hf_greedy(hf_model, prompt, max_tokens), f"prompt {i} (len {len(prompt)})"
    assert_all_blocks_free(engine)
    return engine


@pytest.mark.parametrize("family", sorted(checkpoints.FAMILIES))
def test_greedy_matches_transformers_on_mixed_prompt_lengths(checkpoint_dirs, family):
    check_parity(checkpoint_dirs, family, mixed_prompts(7), block_size=8)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_matches_transformers_under_preemption(checkpoint_dirs, preemption_mode):
    # 8 prompts of up to 40 tokens + 12 new need up to 7 blocks of 8 each; 16 blocks hold
    # only a few of them at once, so the scheduler must preempt.
    engine = check_parity(checkpoint_dirs, "llama", mixed_prompts(8, seed=1), block_size=8,
                          num_gpu_blocks_override=16, preemption_mode=preemption_mode)
    assert sum(s.num_preemption_iter for s in engine.collector.stats) > 0


def test_swap_mode_moves_blocks_through_the_cpu_pool(checkpoint_dirs):
    path, _ = checkpoint_dirs["llama"]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8, num_gpu_blocks_override=16,
                                                   preemption_mode="swap"))
    recorder = SnapshotRecorder(engine)
    run_all(engine, mixed_prompts(8, seed=1), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert any(s.blocks_to_swap_out for s in recorder.snapshots)
    assert any(s.blocks_to_swap_in for s in recorder.snapshots)
    assert_all_blocks_free(engine)


def test_greedy_matches_transformers_with_prefix_caching(checkpoint_dirs):
    rng = random.Random(2)
    shared = [rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(33)]
    prompts = [shared + [rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(n)] for n in (1, 5, 9, 0)]
    # One request every 20 steps: earlier ones have computed (and cached) the shared blocks.
    engine = check_parity(checkpoint_dirs, "qwen2", prompts, stagger=20, block_size=8,
                          enable_prefix_caching=True)
    assert engine.scheduler.get_prefix_cache_hit_rate() > 0


def test_greedy_matches_transformers_with_chunked_prefill(checkpoint_dirs):
    engine = check_parity(checkpoint_dirs, "qwen3", mixed_prompts(7, seed=3), block_size=8,
                          enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)
    assert max(s.num_prompt_tokens_iter for s in engine.collector.stats) <= 16


def test_greedy_matches_transformers_with_everything_on(checkpoint_dirs):
    """Chunked prefill + prefix caching + a pool small enough to preempt, prompts staggered."""
    rng = random.Random(4)
    shared = [rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(17)]
    prompts = [shared + p for p in mixed_prompts(7, seed=4, max_len=24)]
    # Up to 41 + 24 tokens (9 blocks) each, up to 4 running at once, in a pool of 10 blocks.
    engine = check_parity(checkpoint_dirs, "llama", prompts, stagger=1, max_tokens=24, block_size=8,
                          enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=4,
                          enable_prefix_caching=True, num_gpu_blocks_override=10)
    assert sum(s.num_preemption_iter for s in engine.collector.stats) > 0
    assert engine.scheduler.get_prefix_cache_hit_rate() > 0
