import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("engine_test_checkpoints", Path(__file__).with_name("checkpoints.py"))
checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoints)


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    """family -> (saved folder, transformers model), built once per test session."""
    root = tmp_path_factory.mktemp("engine-checkpoints")
    return {family: (str(root / family), checkpoints.save_checkpoint(family, root / family))
            for family in checkpoints.FAMILIES}
