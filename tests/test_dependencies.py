"""What a plain `pip install .` must run: `minivllm generate` and `minivllm serve`, with none
of the course tooling's packages (matplotlib, ipywidgets: the `notebooks` extra)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_ONLY = ("matplotlib", "ipywidgets")

# Runs in a fresh interpreter where importing a notebook-only package fails, as it would
# without the extra; then reports which of them were loaded (none may be).
_SCRIPT = f"""
import importlib, importlib.abc, json, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOTEBOOK_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (the notebooks extra is not installed)")
        return None

sys.meta_path.insert(0, Missing())
for module in sys.argv[1:]:
    importlib.import_module(module)
from minivllm.entrypoints.cli import main
for command in ("generate", "serve"):
    try:
        main([command, "--help"])
    except SystemExit as exit:
        assert exit.code == 0, (command, exit.code)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {NOTEBOOK_ONLY!r})))
"""


def test_runtime_imports_without_the_notebook_packages(tmp_path):
    modules = ["minivllm", "minivllm.entrypoints.cli", "minivllm.engine.llm_engine",
               "minivllm.engine.async_llm_engine", "minivllm.entrypoints.openai.api_server",
               "minivllm.entrypoints.llm"]
    result = subprocess.run([sys.executable, "-c", _SCRIPT, *modules], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_core_dependencies_serve_and_leave_the_pictures_to_an_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [_name(d) for d in project["dependencies"]]
    assert {"fastapi", "uvicorn", "prometheus-client"} <= set(names)
    assert not set(NOTEBOOK_ONLY) & set(names)
    extras = project["optional-dependencies"]
    assert set(NOTEBOOK_ONLY) <= {_name(d) for d in extras["notebooks"]}
    assert "minivllm[notebooks]" in extras["dev"]


def _name(requirement: str) -> str:
    for stop in "<>=!~;[ ":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower()
