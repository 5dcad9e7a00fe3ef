"""Attention backends by name: `register_backend(name, module)` and `attention_backend=name`."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels import available_backends, get_ops, reference, register_backend

CALLS = {"decode": 0}


# The five ops: the PyTorch references, one of them counting its calls.
reshape_and_cache = reference.reshape_and_cache
paged_prefill_attention = reference.paged_prefill_attention
copy_blocks = reference.copy_blocks
swap_blocks = reference.swap_blocks


def paged_attention_decode(*args, **kwargs):
    CALLS["decode"] += 1
    return reference.paged_attention_decode(*args, **kwargs)


def test_a_registered_backend_runs_the_model():
    register_backend("counting", __name__)
    assert "counting" in available_backends()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    CALLS["decode"] = 0
    ours = LLM(device="cpu", attention_backend="counting").generate(["ROMEO:"], params)[0].outputs[0].token_ids
    plain = LLM(device="cpu", attention_backend="torch").generate(["ROMEO:"], params)[0].outputs[0].token_ids
    assert ours == plain and CALLS["decode"] > 0


def test_a_module_object_is_a_backend():
    """A module built in this process (a lab notebook's ops) registers without a file to import."""
    import types

    module = types.ModuleType("built_here")
    for op in ("reshape_and_cache", "paged_prefill_attention", "copy_blocks", "swap_blocks"):
        setattr(module, op, getattr(reference, op))
    module.paged_attention_decode = paged_attention_decode
    register_backend("built-here", module)
    assert get_ops("built-here").paged_attention_decode is paged_attention_decode


def test_bad_backends_are_refused():
    with pytest.raises(ValueError, match="built-in"):
        register_backend("torch", __name__)
    register_backend("incomplete", "minivllm.kernels")  # a module without the five ops
    with pytest.raises(ValueError, match="lacks ops"):
        get_ops("incomplete")
    with pytest.raises(ValueError, match="unknown attention backend"):
        LLM(device="cpu", attention_backend="nope")


def test_only_capturable_backends_get_cuda_graphs():
    """The PyTorch references synchronise with the host, so a CUDA graph cannot hold them; a
    registered backend says whether it can be captured."""
    from minivllm.kernels import supports_cuda_graphs

    assert supports_cuda_graphs("triton") and not supports_cuda_graphs("torch")
    register_backend("capturable", __name__, cuda_graphs=True)
    assert supports_cuda_graphs("capturable")
    register_backend("capturable", __name__)  # registered again without the promise
    assert not supports_cuda_graphs("capturable")


def _graphs_and_tokens(**kwargs) -> tuple[bool, list[int]]:
    """Whether the engine's runner replays CUDA graphs, and its greedy tokens (the engine is
    dropped on return, so the next one gets the GPU memory back)."""
    from minivllm.worker.cuda_graph_runner import CUDAGraphModelRunner

    llm = LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.2, **kwargs)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    tokens = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids
    return isinstance(runner, CUDAGraphModelRunner), list(tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_torch_backend_runs_eagerly_on_a_gpu():
    eager, eager_tokens = _graphs_and_tokens(attention_backend="torch")
    graphs, graph_tokens = _graphs_and_tokens()
    assert not eager and graphs
    assert eager_tokens == graph_tokens
