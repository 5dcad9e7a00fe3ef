"""Greedy output token-identical to transformers (fp32, CPU) with the model split over
processes: TP=2, PP=2, TP=2 x PP=2 and TP=4 (more ranks than the 2 KV heads), for every
family; the ranks talk over gloo, the `mp` executor runs them.

Kept small for CI's two cores: 3 prompts, 4 new tokens, and the worker processes fork from a
server that has imported torch once (see minivllm/executor/multiproc_executor.py).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.distributed import model_parallel_is_initialized
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.worker.multi_step_model_runner import MultiStepModelRunner

import engine_test_checkpoints as checkpoints
from engine_test_checkpoints import assert_all_blocks_free

PROMPTS = [[5, 9, 14], [3] * 9 + [40, 41], [17, 70, 23, 99, 8, 12, 60]]  # across block edges (block size 8)
MAX_TOKENS = 4
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2), "tp4": (4, 1)}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def run_greedy(engine: LLMEngine, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[int(output.request_id)] = output.outputs[0].token_ids
    return [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def references(parallel_checkpoints):
    return {family: [checkpoints.hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
            for family, (_, model) in parallel_checkpoints.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(parallel_checkpoints, references, family, layout):
    tp, pp = LAYOUTS[layout]
    path, _ = parallel_checkpoints[family]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8, tensor_parallel_size=tp,
                                                   pipeline_parallel_size=pp))
    try:
        assert run_greedy(engine, PROMPTS) == references[family]
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
    # The driver left its process groups: the next engine in this process may form new ones.
    assert not model_parallel_is_initialized() and not torch.distributed.is_initialized()


def test_block_count_is_the_minimum_over_workers(parallel_checkpoints, monkeypatch):
    """Each worker sizes the pool for its own share; the engine gets the smallest count."""
    from minivllm.executor.distributed_executor import DistributedExecutorBase

    class Stub(DistributedExecutorBase):
        def _init_executor(self):
            pass

        def _run_workers(self, method, *args):
            return [(12, 30), (9, 41), (15, 7)]

    assert Stub.__new__(Stub).determine_num_available_blocks() == (9, 7)


def test_layouts_the_model_cannot_take_are_refused(parallel_checkpoints):
    path, _ = parallel_checkpoints["llama"]  # 4 heads, 2 KV heads, 2 layers, intermediate 128
    with pytest.raises(ValueError, match="attention heads do not divide"):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="only 2 layers"):
        EngineArgs(model=path, device="cpu", pipeline_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(model=path, device="cpu", tensor_parallel_size=2,
                   distributed_executor_backend="threads").create_engine_config()
    with pytest.raises(ValueError, match="multi-step"):
        EngineArgs(model=path, device="cpu", pipeline_parallel_size=2, num_scheduler_steps=4).create_engine_config()


def test_more_ranks_than_gpus_is_refused(parallel_checkpoints, monkeypatch):
    path, _ = parallel_checkpoints["llama"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="1 GPU"):
        EngineArgs(model=path, device="cuda", tensor_parallel_size=2).create_engine_config()


def test_kv_heads_that_neither_divide_nor_replicate_are_refused(parallel_checkpoints):
    path, _ = parallel_checkpoints["llama"]
    args = EngineArgs(model=path, device="cpu")
    config = args.create_engine_config()
    config.model_config.hf_config.num_attention_heads = 12
    config.model_config.hf_config.num_key_value_heads = 3  # 3 KV heads over 2 ranks
    from minivllm.config import ParallelConfig

    with pytest.raises(ValueError, match="KV heads"):
        config.model_config.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=2))


def test_command_line_flags_with_vllm_names():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["-tp", "2", "-pp", "2", "--distributed-executor-backend", "ray"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend) == (2, 2, "ray")
    long_form = parser.parse_args(["--tensor-parallel-size", "4"])
    assert long_form.tensor_parallel_size == 4 and long_form.distributed_executor_backend is None
    with pytest.raises(SystemExit):  # argparse refuses a backend it does not know
        parser.parse_args(["--distributed-executor-backend", "threads"])
    assert args.create_engine_config().parallel_config.disable_custom_all_reduce is False
    nccl_only = EngineArgs.from_cli_args(parser.parse_args(["-tp", "2", "--disable-custom-all-reduce"]))
    assert nccl_only.create_engine_config().parallel_config.disable_custom_all_reduce is True


def test_multi_step_at_tp2_gives_the_single_step_tokens(parallel_checkpoints, references, monkeypatch):
    """Multi-step scheduling with tensor parallelism: TP rank 0 samples and broadcasts each
    step's tokens, which rank 1 feeds into its next step on the device. Greedy: transformers'
    tokens; seeded sampling: exactly the tokens of one step per schedule (same logits, same
    seeds), which a rank fed the wrong tokens could not reproduce (its partial sums go into
    every layer's all-reduce)."""
    path, _ = parallel_checkpoints["llama"]
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=9, ignore_eos=True)
    multi_step_runs = []  # on rank 0, the engine's process (the other rank runs the same steps)
    run_steps = MultiStepModelRunner.execute_model
    monkeypatch.setattr(MultiStepModelRunner, "execute_model",
                        lambda self, *args: (multi_step_runs.append(1), run_steps(self, *args))[1])

    def run(steps: int) -> tuple[list[list[int]], list[list[int]]]:
        engine = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8, tensor_parallel_size=2,
                                                       num_scheduler_steps=steps))
        try:
            greedy = run_greedy(engine, PROMPTS)
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, sampled)
            outputs = {}
            while engine.has_unfinished_requests():
                outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            assert_all_blocks_free(engine)
            return greedy, [outputs[f"s{i}"] for i in range(len(PROMPTS))]
        finally:
            engine.shutdown()

    greedy, sampled_multi = run(steps=4)
    assert multi_step_runs  # the tokens came from multi-step runs, not a silent single-step fallback
    assert greedy == references["llama"]
    assert run(steps=1)[1] == sampled_multi
