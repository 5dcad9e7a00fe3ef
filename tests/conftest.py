"""Shared test setup.

On a machine without a GPU the Triton kernels run in Triton's interpreter, which must be
chosen before triton is imported: set it here, before any test module imports a kernel.

`tests/engine/checkpoints.py` (tiny random checkpoints of each model family) is loaded by path
and registered as the module `engine_test_checkpoints`, once for the whole session, so test
files in any folder can `import engine_test_checkpoints`: pytest's importlib mode keeps
tests/ itself off sys.path.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHECKPOINTS_MODULE = "engine_test_checkpoints"
if CHECKPOINTS_MODULE not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        CHECKPOINTS_MODULE, Path(__file__).parent / "engine" / "checkpoints.py")
    sys.modules[CHECKPOINTS_MODULE] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[CHECKPOINTS_MODULE])
checkpoints = sys.modules[CHECKPOINTS_MODULE]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, transformers model) of a tiny random Llama with a character tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama") / "llama"
    return str(path), checkpoints.save_checkpoint("llama", path)
