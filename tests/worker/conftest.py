"""Fixtures for the worker tests: the shared tiny Llama checkpoint (tests/conftest.py)."""

import pytest
import torch

torch.set_num_threads(1)  # tiny tensors: see tests/engine/conftest.py


@pytest.fixture(scope="session")
def llama_dir(tiny_llama):
    """(folder, transformers model) of a tiny random Llama."""
    return tiny_llama
