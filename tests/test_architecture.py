"""The architecture's rules, checked on the source itself.

Every module of `minivllm/` and `kernels/` is parsed with `ast` (`minivllm.viz.archmap`);
no minivllm module is imported to find its imports. The rules:

1. `minivllm/core/**` and `minivllm/sequence.py` import no torch, directly or through other
   minivllm modules, so the scheduler and block manager run in a notebook with no model.
2. The import graph is a DAG (no cycles).
3. Layers import only downward, by the table `MAY_IMPORT` of `minivllm/viz/layers.py`.
4. No top-level package named `kernels` is importable (transformers probes for one).
5. `minivllm.kernels` is the top-level `kernels/` folder.

6. The runtime (`core/`, `engine/`) imports nothing from the course tooling (`viz/`: the
   pictures, the snapshots, the simulator), not even deferred or for type checking.

Adding a new top-level module or sub-package? Give it a layer in `LAYERS` of
`minivllm/viz/layers.py` and a row of `MAY_IMPORT` there if it is a new layer.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

from minivllm.viz import archmap
from minivllm.viz.layers import MAY_IMPORT

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = REPO / "minivllm"

# Outside packages that are torch or pull it in when imported.
TORCH_DEPENDENT = ("torch", "triton", "transformers", "accelerate", "safetensors.torch")

_HOW_TO_ADD = (
    "give each a layer in LAYERS of minivllm/viz/layers.py (and, for a new layer, a row in "
    "its MAY_IMPORT and a place in its ROWS)"
)


@functools.cache
def _modules() -> dict[str, Path]:
    return archmap.find_modules(PACKAGE_ROOT)


def _where(module: str, lineno: int | None = None) -> str:
    path = _modules()[module]
    shown = path.relative_to(REPO) if REPO in path.parents else path
    return f"{shown}:{lineno}" if lineno else str(shown)


def _is_torch_free_module(module: str) -> bool:
    return module in ("minivllm.sequence", "minivllm.core") or module.startswith("minivllm.core.")


def _is_torch_dependent(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in TORCH_DEPENDENT)


def _ancestors(module: str) -> list[str]:
    """Packages Python runs before `module`: "minivllm", "minivllm.core" for its scheduler."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


# --- the table itself -------------------------------------------------------------------------


def test_every_module_has_a_layer():
    unlisted = [m for m in _modules() if archmap.layer_of(m) is None]
    assert not unlisted, f"modules in no layer: {unlisted}; {_HOW_TO_ADD}."


def test_layer_tables_agree():
    assert set(MAY_IMPORT) == set(archmap.LAYERS), "MAY_IMPORT and LAYERS name different layers"
    placed = [layer for row in archmap.ROWS for layer in row]
    assert sorted(placed) == sorted(archmap.LAYERS), "each layer needs one place in archmap.ROWS"
    for layer, allowed in MAY_IMPORT.items():
        assert layer in allowed and allowed <= set(MAY_IMPORT), layer


# --- rule 1: no torch in the scheduler --------------------------------------------------------


def test_torch_free_modules_import_no_torch_themselves():
    """Not even deferred inside a function or under TYPE_CHECKING: core is plain Python."""
    modules = _modules()
    assert "minivllm.sequence" in modules
    offending = [
        f"{_where(e.importer, e.lineno)} imports {e.imported}"
        for e in archmap.scan_imports(PACKAGE_ROOT)
        if _is_torch_free_module(e.importer) and _is_torch_dependent(e.imported)
    ]
    assert not offending, "core and sequence.py must be plain Python:\n" + "\n".join(offending)


def test_torch_free_modules_import_no_torch_transitively():
    """Follow what runs at import time: module-level imports and the parent packages' __init__s
    (importing minivllm.core.scheduler first runs minivllm/__init__.py). Imports deferred into
    a function elsewhere (config's `from transformers import AutoConfig`) run only when that
    function is called, which core never does, so they are not followed."""
    modules = _modules()
    runs_at_import: dict[str, set[str]] = {m: set(_ancestors(m)) & set(modules) for m in modules}
    for edge in archmap.scan_imports(PACKAGE_ROOT):
        if edge.at_import_time:
            runs_at_import[edge.importer].add(edge.imported)
            parents = [a for a in _ancestors(edge.imported) if a in modules]
            runs_at_import[edge.importer].update(parents)
    problems = []
    for start in filter(_is_torch_free_module, modules):
        chain = _path_to_torch(start, runs_at_import)
        if chain:
            problems.append(" -> ".join(chain))
    hint = (
        "\n(If a chain goes through `minivllm`, the root package: minivllm/__init__.py must "
        "import LLM and friends lazily, with a module-level __getattr__ (PEP 562), so that "
        "`import minivllm.core` stays light.)"
    )
    assert not problems, "torch reached at import time:\n" + "\n".join(problems) + hint


def _path_to_torch(start: str, runs_at_import: dict[str, set[str]]) -> list[str] | None:
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        if _is_torch_dependent(module):
            chain = [module]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for nxt in sorted(runs_at_import.get(module, ())):
            if nxt not in parent:
                parent[nxt] = module
                queue.append(nxt)
    return None


def test_torch_free_modules_really_import_no_torch(tmp_path):
    """The same rule, asked of Python's import system in a fresh interpreter."""
    modules = [m for m in _modules() if _is_torch_free_module(m)]
    heavy = ("torch", "triton", "transformers")
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing {modules} loaded {loaded[:5]}..."


# --- rule 2: a DAG ------------------------------------------------------------------------------


def test_import_graph_is_acyclic():
    """Only imports that run while a module loads can deadlock into a partially initialised
    module, so imports deferred into functions (e.g. `get_ops` importing the Triton modules on
    first use) and `if TYPE_CHECKING:` imports are left out here. They still count for the
    layering rule below, so a deferred import cannot be used to reach upward."""
    graph = archmap.import_graph(PACKAGE_ROOT, deferred=False, type_checking=False)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# --- rule 3: layers import downward -------------------------------------------------------------


def test_layers_import_only_downward():
    modules = _modules()
    violations = []
    for edge in archmap.scan_imports(PACKAGE_ROOT):
        if edge.imported not in modules:
            continue
        src, dst = archmap.layer_of(edge.importer), archmap.layer_of(edge.imported)
        if src is None or dst is None:
            continue  # reported by test_every_module_has_a_layer
        if dst not in MAY_IMPORT[src]:
            violations.append(
                f"{_where(edge.importer, edge.lineno)} ({src}) imports {edge.imported} ({dst}); "
                f"{src} may import only {sorted(MAY_IMPORT[src])}"
            )
    assert not violations, "upward imports:\n" + "\n".join(violations)


# --- rule 6: the runtime knows nothing of the course tooling ---------------------------------


def test_core_and_engine_import_nothing_from_the_course_tooling():
    """Snapshots, pictures and the simulator observe the engine from outside (`StepObserver`,
    public queries); the runtime must never reach back into them."""
    modules = _modules()
    runtime = [m for m in modules if m.split(".")[:2] in (["minivllm", "core"], ["minivllm", "engine"])]
    assert "minivllm.core.scheduler" in runtime and "minivllm.engine.llm_engine" in runtime
    offending = [
        f"{_where(e.importer, e.lineno)} imports {e.imported}"
        for e in archmap.scan_imports(PACKAGE_ROOT)
        if e.importer in runtime and (e.imported == "minivllm.viz" or e.imported.startswith("minivllm.viz."))
    ]
    assert not offending, "the runtime imports course tooling:\n" + "\n".join(offending)


# --- rules 4 and 5: the kernels folder --------------------------------------------------------


def test_no_top_level_kernels_package_in_this_process():
    assert importlib.util.find_spec("kernels") is None, (
        "`import kernels` works in the test process: the repository root is on sys.path "
        "(run `pytest`, not `python -m pytest`, from the repo root); transformers would take "
        "our folder for the `kernels` package it probes for."
    )


def test_no_top_level_kernels_package_installed(tmp_path):
    """From a neutral directory (so the current folder adds nothing to sys.path)."""
    script = "import importlib.util; print(importlib.util.find_spec('kernels') is None)"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "True", result.stdout + result.stderr


def test_minivllm_kernels_is_the_top_level_kernels_folder():
    spec = importlib.util.find_spec("minivllm.kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == REPO / "kernels" / "__init__.py"
    # The ast reader looks in the same place as Python's import system.
    assert archmap.kernels_dir(PACKAGE_ROOT) == REPO / "kernels"
    assert _modules()["minivllm.kernels"] == REPO / "kernels" / "__init__.py"
