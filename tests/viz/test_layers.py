"""The architecture map's data names real things: every minivllm module it lists exists, and
every vLLM path is a file (or folder) of vLLM 0.6.3 (tests/data/vllm_0.6.3_files.txt)."""

from __future__ import annotations

from pathlib import Path

from minivllm.viz import archmap
from minivllm.viz.layers import LAYERS, MAY_IMPORT, ROWS, VLLM_PATHS, layer_of

VLLM_FILES = Path(__file__).resolve().parents[1] / "data" / "vllm_0.6.3_files.txt"


def _vllm_files() -> set[str]:
    lines = VLLM_FILES.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def test_every_minivllm_entry_is_a_module():
    modules = archmap.find_modules()
    missing = [m for m in VLLM_PATHS if m not in modules]
    assert not missing, f"VLLM_PATHS names minivllm modules that do not exist: {missing}"


def test_every_vllm_path_exists_in_vllm_0_6_3():
    files = _vllm_files()
    assert "vllm/core/scheduler.py" in files and len(files) > 900  # the list itself is sane

    def exists(path: str) -> bool:
        return path in files if not path.endswith("/") else any(f.startswith(path) for f in files)

    missing = {m: p for m, p in VLLM_PATHS.items() if not exists(p)}
    assert not missing, f"paths not in vLLM 0.6.3: {missing}"


def test_the_check_catches_a_wrong_entry():
    files = _vllm_files()
    assert "vllm/core/block_manager_v1.py" in files  # dropped after 0.6.3
    assert "vllm/core/block_manager.py" not in files  # its later name
    assert archmap.find_modules().get("minivllm.core.evictor") is None


def test_rule_tables_are_consistent():
    assert set(MAY_IMPORT) == set(LAYERS) == {layer for row in ROWS for layer in row}
    assert layer_of("minivllm.viz.sim") == "viz" and layer_of("minivllm.viz.style") == "foundation"
    assert "viz" not in MAY_IMPORT["engine"] | MAY_IMPORT["core"]  # the runtime never imports tooling
