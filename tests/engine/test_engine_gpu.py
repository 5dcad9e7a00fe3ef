"""The engine on a GPU: CUDA-graph decode gives the same tokens as eager decode, and the
KV pool comes from the memory profile.

(The CPU parity tests cover the engine's logic; on a GPU the same code adds the Triton
kernels and CUDA graphs. Run on the GPU machine with `pytest -m gpu`.)
"""

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.worker.cuda_graph_runner import CUDAGraphModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me", "KING:"]
GiB = 1 << 30


def greedy_run(**engine_args) -> tuple[list[list[int]], tuple[list[int], list[int]], bool]:
    """Greedy tokens for PROMPTS, the captured graphs' sizes (decode batch sizes, prefill token
    counts), and whether every block came back.

    The engine lives only inside this function: the next engine's memory profile must see
    its KV cache freed (`Worker.init_device` collects garbage and empties the CUDA cache).
    """
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.4,
              **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    engine = llm.llm_engine
    runner = engine.model_executor.driver_worker.model_runner
    # An eager engine runs the plain ModelRunner; a graphed one the CUDA-graph subclass.
    graphed = isinstance(runner, CUDAGraphModelRunner)
    graph_sizes = (sorted(runner.graph_runners), sorted(runner.prefill_graph_runners)) if graphed else ([], [])
    all_free = engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    return tokens, graph_sizes, all_free


def test_cuda_graphs_give_the_eager_tokens():
    eager, eager_graphs, _ = greedy_run(enforce_eager=True)
    graphed, graph_sizes, all_free = greedy_run()
    # Prompts are prefilled from graphs of up to 2048 tokens (the budget: max(max_model_len, 2048)).
    assert eager_graphs == ([], []) and graph_sizes == ([1, 2, 4, 8], [512, 1024, 1536, 2048])
    assert graphed == eager
    assert all_free


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_multi_step_decode_gives_the_single_step_tokens(enforce_eager):
    """Eight decode steps per schedule, tokens fed back on the GPU (graph replays or eager)."""
    single, _, _ = greedy_run(enforce_eager=enforce_eager)
    multi, _, all_free = greedy_run(enforce_eager=enforce_eager, num_scheduler_steps=8)
    assert multi == single
    assert all_free


def test_gpu_block_count_comes_from_the_profile():
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    in_use_before = total - free
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.4,
              enforce_eager=True)
    worker = llm.llm_engine.model_executor.driver_worker
    pool_bytes = llm.llm_engine.cache_config.num_gpu_blocks * worker.get_cache_block_size_bytes()
    # 40 % of the GPU, less what was in use, less this 5M-parameter model's weights and
    # profile activations (well under 2 GiB).
    budget = 0.4 * total - in_use_before
    assert budget - 2 * GiB <= pool_bytes <= budget
