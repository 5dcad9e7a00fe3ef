"""The engine on a GPU: CUDA-graph decode gives the same tokens as eager decode.

(The CPU parity tests cover the engine's logic; on a GPU the same code adds the Triton
kernels and CUDA graphs. Run on the GPU machine with `pytest -m gpu`.)
"""

import pytest
import torch

from minivllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me", "KING:"]


def greedy_tokens(**engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def test_cuda_graph_decode_gives_the_eager_tokens():
    eager, eager_llm = greedy_tokens(enforce_eager=True)
    graphed, graphed_llm = greedy_tokens()
    runner = graphed_llm.llm_engine.model_executor.driver_worker.model_runner
    assert sorted(runner.graph_runners) == [1, 2, 4, 8]
    assert not eager_llm.llm_engine.model_executor.driver_worker.model_runner.graph_runners
    assert graphed == eager
    engine = graphed_llm.llm_engine
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_gpu_block_count_comes_from_the_profile():
    _, llm = greedy_tokens(enforce_eager=True, gpu_memory_utilization=0.5)
    worker = llm.llm_engine.model_executor.driver_worker
    block_bytes = worker.get_cache_block_size_bytes()
    _, total = torch.cuda.mem_get_info()
    num_blocks = llm.llm_engine.cache_config.num_gpu_blocks
    # The pool fits in half the GPU, and is most of what half the GPU leaves after a 5M model.
    assert num_blocks * block_bytes <= 0.5 * total
    assert num_blocks * block_bytes >= 0.4 * total
