"""Attention backends by name: `register_backend(name, module)` and `attention_backend=name`."""

from __future__ import annotations

import pytest

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


def test_bad_backends_are_refused():
    with pytest.raises(ValueError, match="built-in"):
        register_backend("torch", __name__)
    register_backend("incomplete", "minivllm.kernels")  # a module without the five ops
    with pytest.raises(ValueError, match="lacks ops"):
        get_ops("incomplete")
    with pytest.raises(ValueError, match="unknown attention backend"):
        LLM(device="cpu", attention_backend="nope")
