"""Fixtures for the engine tests: tiny random checkpoints saved once per session.

`checkpoints.py` is registered as the module `engine_test_checkpoints` by tests/conftest.py.
"""

import sys

import pytest
import torch

# These models are tiny (hidden 64): a second intra-op thread only adds synchronisation, and
# on a loaded 2-core machine each small op then waits milliseconds for it (measured: 100x
# slower softmax on [4, 1, 40]). One thread keeps the engine tests fast everywhere.
torch.set_num_threads(1)

checkpoints = sys.modules["engine_test_checkpoints"]  # registered by tests/conftest.py


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    """family -> (saved folder, transformers model), built once per test session."""
    root = tmp_path_factory.mktemp("engine-checkpoints")
    return {family: (str(root / family), checkpoints.save_checkpoint(family, root / family))
            for family in checkpoints.FAMILIES}
