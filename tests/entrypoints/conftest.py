"""Fixtures for the entry-point tests: the engine tests' tiny checkpoints (loaded by path)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tiny tensors: see tests/engine/conftest.py

MODULE_NAME = "engine_test_checkpoints"
if MODULE_NAME not in sys.modules:
    _path = Path(__file__).parents[1] / "engine" / "checkpoints.py"
    _spec = importlib.util.spec_from_file_location(MODULE_NAME, _path)
    sys.modules[MODULE_NAME] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[MODULE_NAME])
checkpoints = sys.modules[MODULE_NAME]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, transformers model) of a tiny random Llama with a character tokenizer."""
    path = tmp_path_factory.mktemp("entrypoint-checkpoint") / "llama"
    return str(path), checkpoints.save_checkpoint("llama", path)
