"""Speculative decoding on a GPU: Triton kernels, CUDA graphs for the baseline and the draft's
decode steps, the memory profile with two models. Greedy output must equal the target alone.

(The CPU tests cover the logic; run these on the GPU machine with `pytest -m gpu`.)
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

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "KING HENRY:", "HAMLET:", "MENENIUS:", "PROSPERO:"]


def greedy_run(**engine_args):
    """Greedy tokens of PROMPTS, the speculative metrics (or None), the block-count and
    all-blocks-free checks. The engine lives only inside this function (the next profile must
    see its memory freed)."""
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=256,
              **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    engine = llm.llm_engine
    worker = engine.model_executor.driver_worker
    metrics = worker.counter.metrics() if hasattr(worker, "counter") else None
    draft_graphs = isinstance(getattr(getattr(worker, "proposer", None), "model_runner", None), CUDAGraphModelRunner)
    all_free = engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    del llm, engine, worker
    gc.collect()
    return tokens, metrics, draft_graphs, all_free


@pytest.fixture(scope="module")
def target_tokens():
    tokens, _, _, all_free = greedy_run()
    assert all_free
    return tokens


def test_bundled_draft_on_gpu_gives_the_targets_tokens(target_tokens):
    tokens, metrics, draft_graphs, all_free = greedy_run(speculative_model="tiny-shakespeare-draft",
                                                         num_speculative_tokens=4)
    assert tokens == target_tokens
    assert draft_graphs  # the draft's one-token decode steps replay CUDA graphs
    assert metrics.draft_tokens > 0 and metrics.draft_acceptance_rate > 0.3
    assert all_free


def test_ngram_on_gpu_gives_the_targets_tokens(target_tokens):
    tokens, metrics, _, all_free = greedy_run(speculative_model="[ngram]", num_speculative_tokens=4,
                                              ngram_prompt_lookup_max=3)
    assert tokens == target_tokens
    assert metrics.draft_tokens > 0
    assert all_free
