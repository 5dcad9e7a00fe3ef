"""The engine on a GPU: CUDA-graph decode gives the same tokens as eager decode, and the
KV pool comes from the memory profile.

(The CPU parity tests cover the engine's logic; on a GPU the same code adds the Triton
kernels and CUDA graphs. Run on the GPU machine with `pytest -m gpu`.)
"""

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me", "KING:"]
GiB = 1 << 30


def release(llm: LLM) -> None:
    """Drop an engine and give its KV cache back, so the next engine can profile the GPU."""
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def make_llm(**engine_args) -> LLM:
    return LLM(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.4,
               **engine_args)


def test_cuda_graph_decode_gives_the_eager_tokens():
    eager_llm = make_llm(enforce_eager=True)
    assert not eager_llm.llm_engine.model_executor.driver_worker.model_runner.graph_runners
    eager = greedy_tokens(eager_llm)
    release(eager_llm)
    graphed_llm = make_llm()
    runner = graphed_llm.llm_engine.model_executor.driver_worker.model_runner
    assert sorted(runner.graph_runners) == [1, 2, 4, 8]
    assert greedy_tokens(graphed_llm) == eager
    engine = graphed_llm.llm_engine
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    release(graphed_llm)


def test_gpu_block_count_comes_from_the_profile():
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    in_use_before = total - free
    llm = make_llm(enforce_eager=True)
    pool_bytes = llm.llm_engine.cache_config.num_gpu_blocks * llm.llm_engine.model_executor.driver_worker.get_cache_block_size_bytes()
    # 40 % of the GPU, less what was in use, less this 5M-parameter model's weights and
    # profile activations (well under 2 GiB).
    budget = 0.4 * total - in_use_before
    assert budget - 2 * GiB <= pool_bytes <= budget
    release(llm)
