"""The architecture map: the ast import reader against Python's own import semantics, and
the drawing on a small graph whose shape we know."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minivllm.viz import archmap  # noqa: E402
from minivllm.viz.style import COLORS  # noqa: E402


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_repo(tmp_path):
    """A tiny minivllm-shaped tree with one import of each kind; `kernels/` beside the package
    as in the repository."""
    _write(
        tmp_path,
        {
            "minivllm/__init__.py": "from minivllm.sequence import Sequence\n",
            "minivllm/sequence.py": "import enum\nclass Sequence: pass\n",
            "minivllm/config.py": """
                from __future__ import annotations
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from minivllm.core.scheduler import Scheduler
                else:
                    import json
                def build():
                    import torch
                    from minivllm.kernels import ops
            """,
            "minivllm/core/__init__.py": "",
            "minivllm/core/scheduler.py": """
                from . import block_manager
                from ..sequence import Sequence
                from minivllm.core import policy_name
                try:
                    import numpy as np
                except ImportError:
                    np = None
                class Scheduler:
                    import collections
                    def schedule(self):
                        from minivllm import config
            """,
            "minivllm/core/block_manager.py": "import minivllm.sequence\n",
            "minivllm/bundled_models/tiny-shakespeare/ignored.py": "import torch\n",
            "kernels/__init__.py": "def get_ops():\n    from minivllm.kernels import ops\n",
            "kernels/ops.py": "import torch\nfrom . import helpers\n",
            "kernels/helpers.py": "",
        },
    )
    return tmp_path


def test_find_modules_names_packages_by_folder_and_maps_kernels(fake_repo):
    modules = archmap.find_modules(fake_repo / "minivllm")
    assert sorted(modules) == [
        "minivllm",
        "minivllm.config",
        "minivllm.core",
        "minivllm.core.block_manager",
        "minivllm.core.scheduler",
        "minivllm.kernels",
        "minivllm.kernels.helpers",
        "minivllm.kernels.ops",
        "minivllm.sequence",
    ]  # the dashed data folder is not a package, so its .py is no module
    assert modules["minivllm.kernels.ops"] == fake_repo / "kernels" / "ops.py"


def test_import_graph_resolves_every_kind_of_import(fake_repo):
    graph = archmap.import_graph(fake_repo / "minivllm")
    assert graph == {
        "minivllm": {"minivllm.sequence"},
        "minivllm.config": {"minivllm.core.scheduler", "minivllm.kernels.ops"},
        "minivllm.core": set(),
        # `from . import block_manager` is a submodule; `from minivllm.core import policy_name`
        # an attribute of the package; `from minivllm import config` (deferred) a submodule.
        "minivllm.core.scheduler": {
            "minivllm.core.block_manager",
            "minivllm.sequence",
            "minivllm.core",
            "minivllm.config",
        },
        "minivllm.core.block_manager": {"minivllm.sequence"},
        "minivllm.kernels": {"minivllm.kernels.ops"},
        "minivllm.kernels.helpers": set(),
        "minivllm.kernels.ops": {"minivllm.kernels.helpers"},
        "minivllm.sequence": set(),
    }


def test_import_graph_can_keep_only_what_runs_at_import_time(fake_repo):
    graph = archmap.import_graph(fake_repo / "minivllm", deferred=False, type_checking=False)
    assert graph["minivllm.config"] == set()
    assert graph["minivllm.kernels"] == set()
    assert "minivllm.config" not in graph["minivllm.core.scheduler"]


def test_scan_imports_marks_when_each_import_runs(fake_repo):
    edges = {(e.importer, e.imported): e for e in archmap.scan_imports(fake_repo / "minivllm")}
    assert edges[("minivllm.config", "minivllm.core.scheduler")].type_checking
    assert edges[("minivllm.config", "json")].at_import_time  # the else branch runs
    assert edges[("minivllm.config", "torch")].deferred
    assert edges[("minivllm.core.scheduler", "numpy")].at_import_time  # try/except still runs
    assert edges[("minivllm.core.scheduler", "collections")].at_import_time  # class bodies run
    assert edges[("minivllm.core.scheduler", "minivllm.config")].deferred


def test_ast_graph_agrees_with_pythons_import_system(tmp_path):
    """For each module whose import-time closure (by the ast reader) needs no torch, import it
    in a fresh interpreter and compare the minivllm modules Python actually loaded with the
    closure: nothing extra may load (a missed edge) and everything predicted must load.
    A module that fails to import (a teammate's work in progress) is left out of the
    comparison, as long as the foundation and the scheduler are compared."""
    modules = archmap.find_modules()
    runs = {m: set() for m in modules}
    for edge in archmap.scan_imports():
        if edge.at_import_time:
            runs[edge.importer].add(edge.imported)

    def closure(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            parts = module.split(".")
            for name in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
                if name not in seen:
                    seen.add(name)
                    todo.extend(runs.get(name, ()))
        return seen

    light = sorted(
        m for m in modules
        if not m.endswith(".__main__")  # importing it runs the CLI
        and not any(n.split(".")[0] in ("torch", "triton", "transformers") for n in closure(m))
    )
    assert "minivllm.sequence" in light
    script = textwrap.dedent(
        f"""
        import importlib, json, sys
        loaded = {{}}
        for name in {light!r}:
            before = set(sys.modules)
            try:
                importlib.import_module(name)
                failed = False
            except ImportError:
                failed = True
            loaded[name] = [failed, sorted(m for m in set(sys.modules) - before)]
        print(json.dumps(loaded))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    already: set[str] = set()
    compared = set()
    for name in light:
        failed, new = loaded[name][0], {m for m in loaded[name][1] if m.startswith("minivllm")}
        predicted = {m for m in closure(name) if m in modules}
        if not failed:
            assert new <= predicted, f"importing {name} also loaded {sorted(new - predicted)}"
            missing = predicted - new - already
            assert not missing, f"{name}: predicted but not loaded: {sorted(missing)}"
            compared.add(name)
        already |= new
    assert {"minivllm.sequence", "minivllm.config", "minivllm.core"} <= compared


def test_layer_of_uses_the_longest_prefix():
    assert archmap.layer_of("minivllm.viz.style") == "foundation"
    assert archmap.layer_of("minivllm.viz.archmap") == "viz"
    assert archmap.layer_of("minivllm.core.block_manager") == "core"
    assert archmap.layer_of("minivllm.kernels.reference") == "kernels"
    assert archmap.layer_of("minivllm") == "package"
    assert archmap.layer_of("minivllm.something_new") is None
    assert archmap.layer_of("minivllm_other") is None


def test_vllm_paths_point_into_vllms_tree():
    for module, path in archmap.VLLM_PATHS.items():
        assert module == "minivllm" or module.startswith("minivllm."), module
        assert archmap.layer_of(module) is not None, module
        assert path.startswith(("vllm/", "csrc/", "tests/")), path


def test_source_path_names_the_file_in_the_repository():
    assert archmap.source_path("minivllm.core.scheduler") == "minivllm/core/scheduler.py"
    assert archmap.source_path("minivllm.core", package=True) == "minivllm/core/__init__.py"
    assert archmap.source_path("minivllm.kernels.reference") == "kernels/reference.py"


def _arrow_colors(ax) -> list[tuple]:
    return [t.arrow_patch.get_edgecolor() for t in ax.texts if getattr(t, "arrow_patch", None)]


def test_draw_architecture_stacks_layers_and_labels_both_paths():
    graph = {
        "minivllm.entrypoints.llm": {"minivllm.engine.llm_engine"},
        "minivllm.engine.llm_engine": {"minivllm.core.scheduler", "minivllm.worker.worker"},
        "minivllm.core.scheduler": {"minivllm.sequence"},
        "minivllm.worker.worker": {"minivllm.kernels.reference"},
        "minivllm.kernels.reference": set(),
        "minivllm.sequence": set(),
    }
    fig, ax = plt.subplots()
    positions = archmap.draw_architecture(ax, graph)
    plt.close(fig)
    y = {m: positions[m][1] for m in graph}
    top_down = [
        "minivllm.entrypoints.llm", "minivllm.engine.llm_engine", "minivllm.core.scheduler",
        "minivllm.worker.worker", "minivllm.kernels.reference", "minivllm.sequence",
    ]
    assert [y[m] for m in top_down] == sorted((y[m] for m in top_down), reverse=True)
    assert len({y[m] for m in top_down}) == len(top_down)
    texts = {t.get_text() for t in ax.texts}
    assert {"minivllm/core/scheduler.py", "vllm/core/scheduler.py", "kernels/reference.py"} <= texts
    colors = _arrow_colors(ax)
    assert len(colors) == 5 and to_rgba(COLORS["copied"])[:3] not in [c[:3] for c in colors]


def test_draw_architecture_marks_an_upward_import():
    graph = {"minivllm.sequence": {"minivllm.engine.llm_engine"}}
    graph["minivllm.engine.llm_engine"] = set()
    fig, ax = plt.subplots()
    archmap.draw_architecture(ax, graph)
    plt.close(fig)
    assert [c[:3] for c in _arrow_colors(ax)] == [to_rgba(COLORS["copied"])[:3]]


def test_draw_architecture_by_layer_and_on_the_real_package():
    fig, ax = plt.subplots()
    positions = archmap.draw_architecture(ax, level="layer")
    plt.close(fig)
    assert {"minivllm.core", "minivllm.sequence", "minivllm.kernels"} <= set(positions)
    assert positions["minivllm.core"][1] > positions["minivllm.sequence"][1]
    with pytest.raises(ValueError, match="level"):
        archmap.draw_architecture(ax, level="file")
