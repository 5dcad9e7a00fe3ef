"""Fixtures for the engine tests: tiny random checkpoints saved once per session.

`checkpoints.py` is loaded by path and registered as the module `engine_test_checkpoints`,
so test files (here, in tests/worker and in tests/entrypoints) can `import` it: pytest's
importlib mode keeps tests/ itself off sys.path.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# These models are tiny (hidden 64): a second intra-op thread only adds synchronisation, and
# on a loaded 2-core machine each small op then waits milliseconds for it (measured: 100x
# slower softmax on [4, 1, 40]). One thread keeps the engine tests fast everywhere.
torch.set_num_threads(1)

MODULE_NAME = "engine_test_checkpoints"
if MODULE_NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(MODULE_NAME, Path(__file__).with_name("checkpoints.py"))
    sys.modules[MODULE_NAME] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[MODULE_NAME])
checkpoints = sys.modules[MODULE_NAME]


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    """family -> (saved folder, transformers model), built once per test session."""
    root = tmp_path_factory.mktemp("engine-checkpoints")
    return {family: (str(root / family), checkpoints.save_checkpoint(family, root / family))
            for family in checkpoints.FAMILIES}
