"""The backend switch: defaults per device and the clear errors."""

from __future__ import annotations

import pytest

from minivllm.attention import get_attn_backend


def test_defaults_triton_on_cuda_torch_on_cpu():
    assert get_attn_backend(None, "cuda") == "triton"
    assert get_attn_backend(None, "cuda:0") == "triton"
    assert get_attn_backend(None, "cpu") == "torch"
    assert get_attn_backend("torch", "cuda") == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attn_backend("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attn_backend("triton", "cpu")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'torch', 'triton'"):
        get_attn_backend("flash", "cpu")
