"""Virtual engines (PipelineParallelEngine): PP=2 with two batches in flight gives
transformers' greedy tokens, overlaps its calls, and returns every block of every virtual
engine, under swap preemption and aborts."""

from __future__ import annotations

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.pipeline_parallel_engine import PipelineParallelEngine
from minivllm.sampling_params import SamplingParams

import engine_test_checkpoints as checkpoints
from engine_test_checkpoints import assert_all_blocks_free, mixed_prompts


class PreemptionCounter:
    def __init__(self):
        self.preempted = 0

    def log(self, stats) -> None:
        self.preempted += stats.num_preemption_iter


def test_two_virtual_engines_keep_the_pipeline_busy_with_transformers_tokens(checkpoint_dirs):
    path, hf_model = checkpoint_dirs["qwen3"]
    prompts = mixed_prompts(6, max_len=20)
    # 10 blocks, 5 per virtual engine: too few for its 3 requests at once, so they swap.
    engine = PipelineParallelEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8,
                                                                pipeline_parallel_size=2, num_gpu_blocks_override=10,
                                                                preemption_mode="swap"))
    executor = engine.shared.executor
    # Observed from the driver (stage 0, in this process): when its forward starts, how many
    # earlier calls are still in the pipeline (results not collected)?
    uncollected, overlaps = 0, []
    runner = executor.driver_worker.model_runner
    forward, finish = runner.execute_model, executor._finish_call

    def watched_forward(*args, **kwargs):
        nonlocal uncollected
        overlaps.append(uncollected)
        uncollected += 1
        return forward(*args, **kwargs)

    def watched_finish(*args):
        nonlocal uncollected
        results = finish(*args)
        uncollected -= 1
        return results

    runner.execute_model, executor._finish_call = watched_forward, watched_finish
    collectors = [PreemptionCounter() for _ in engine.engines]
    for virtual_engine, collector in zip(engine.engines, collectors):
        virtual_engine.add_logger("preemptions", collector)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        assert [e.get_num_unfinished_requests() for e in engine.engines] == [3, 3]  # spread evenly
        engine.add_request("gone", {"prompt_token_ids": [5, 6, 7]}, params)
        engine.abort_request("gone")
        outputs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
        assert [outputs[str(i)] for i in range(len(prompts))] == [
            checkpoints.hf_greedy(hf_model, p, 6) for p in prompts]
        # Stage 0 started one virtual engine's batch while the other's was still in the pipeline
        # (the plain engine never does: each step waits for its result).
        assert max(overlaps) == 1 and sum(overlaps) > len(overlaps) // 3
        for virtual_engine in engine.engines:
            assert virtual_engine.cache_config.num_gpu_blocks == 5
            assert_all_blocks_free(virtual_engine)
        assert sum(collector.preempted for collector in collectors) > 0
    finally:
        engine.shutdown()


def test_virtual_engines_need_stages_and_processes(checkpoint_dirs):
    path, _ = checkpoint_dirs["llama"]
    with pytest.raises(ValueError, match="pipeline_parallel_size >= 2"):
        PipelineParallelEngine.from_engine_args(EngineArgs(model=path, device="cpu", tensor_parallel_size=2))
