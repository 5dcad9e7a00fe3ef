"""The `ray` executor on a local Ray instance: TP=2 over two actors in a placement group gives
transformers' greedy tokens, a killed actor is a clear error, shutdown frees the bundles.

(Ray is in the `dev` extra, so CI runs this; on a cluster the same executor joins the running
Ray instance instead of starting one.)
"""

from __future__ import annotations

import logging
import time

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.ray_executor import RayDistributedExecutor
from minivllm.sampling_params import SamplingParams

import engine_test_checkpoints as checkpoints
from engine_test_checkpoints import assert_all_blocks_free

ray = pytest.importorskip("ray", reason="ray is in the dev extra; install minivllm[ray]")

PROMPTS = [[5, 9, 14], [17, 70, 23, 99, 8, 12, 60, 4, 4]]


@pytest.fixture(scope="module")
def local_ray():
    # Two CPUs: one bundle per rank. No dashboard: it only costs start-up time here.
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def test_tensor_parallel_over_ray_actors(local_ray, tmp_path):
    hf_model = checkpoints.save_checkpoint("qwen2", tmp_path / "qwen2")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tmp_path / "qwen2"), device="cpu", block_size=8,
                                                   tensor_parallel_size=2, distributed_executor_backend="ray"))
    executor = engine.model_executor
    assert isinstance(executor, RayDistributedExecutor) and len(executor.workers) == 2
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outputs = {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert [outputs[str(i)] for i in range(len(PROMPTS))] == [
            checkpoints.hf_greedy(hf_model, p, 4) for p in PROMPTS]
        assert_all_blocks_free(engine)

        ray.kill(executor.workers[1])
        engine.add_request("late", {"prompt_token_ids": [5, 6]}, params)
        with pytest.raises(WorkerDiedError, match="Ray worker actor.* died"):
            engine.step()
    finally:
        engine.shutdown()
    # Shutdown returned the placement group's CPUs (Ray frees them asynchronously).
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2
