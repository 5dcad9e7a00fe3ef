"""The architecture map: minivllm's import graph, read from its source, drawn layer by layer.

Two halves:

1. **Reading.** `import_graph()` parses every module of `minivllm/` (and of the top-level
   `kernels/` folder, which is imported as `minivllm.kernels`) with `ast` — nothing is imported
   or executed — and returns `{module: {modules it imports}}`. `scan_imports()` gives the
   same edges with line numbers and *when* each import runs (at import time, deferred inside
   a function, or never: under `if TYPE_CHECKING:`). `tests/test_architecture.py` checks the
   layering rules on this graph.
2. **Drawing.** `draw_architecture(ax)` draws that graph with entry points at the top and
   kernels at the bottom; every box names the minivllm file and the vLLM (v0) file it mirrors
   (`VLLM_PATHS`).

The rules themselves (layers, who may import whom, the vLLM counterparts) are plain data in
`minivllm.viz.layers`, read by this map and by `tests/test_architecture.py`.

    >>> graph = import_graph()
    >>> "minivllm.sampling_params" in graph["minivllm.sequence"]
    True
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from matplotlib.colors import to_rgb
from matplotlib.patches import FancyBboxPatch

from minivllm.viz.layers import (  # noqa: F401  (re-exported: notebooks read them from here)
    KERNELS_PACKAGE,
    LAYERS,
    MAY_IMPORT,
    PACKAGE,
    ROWS,
    VLLM_PATHS,
    _longest_prefix,
    layer_of,
    vllm_path,
)
from minivllm.viz.style import COLORS, request_color

# ---------------------------------------------------------------------------------------------
# Reading the graph.


@dataclass(frozen=True)
class ImportEdge:
    """One import statement: `importer` imports `imported` at line `lineno`.

    `imported` is a dotted module name: a minivllm module, or an outside one such as
    "torch.nn". `deferred`: the statement sits inside a function, so it runs only when the
    function is called. `type_checking`: it sits under `if TYPE_CHECKING:`, so it never runs.
    """

    importer: str
    imported: str
    lineno: int
    deferred: bool = False
    type_checking: bool = False

    @property
    def at_import_time(self) -> bool:
        return not (self.deferred or self.type_checking)


def default_package_root() -> Path:
    """The `minivllm/` folder this module was loaded from."""
    return Path(__file__).resolve().parent.parent


def kernels_dir(package_root: Path) -> Path:
    """Where `minivllm.kernels` lives: inside the package once installed as a wheel, else the
    top-level `kernels/` folder beside it (pyproject's `package-dir` maps it there)."""
    inside = package_root / "kernels"
    return inside if inside.is_dir() else package_root.parent / "kernels"


def find_modules(package_root: Path | str | None = None) -> dict[str, Path]:
    """Every module of the package: `{"minivllm.core.scheduler": Path(...)}`.

    A package is named by its folder (`minivllm.core` for `minivllm/core/__init__.py`).
    """
    root = Path(package_root) if package_root is not None else default_package_root()
    modules = _modules_under(root, PACKAGE)
    kernels = kernels_dir(root)
    if kernels.is_dir() and root not in kernels.parents:
        modules.update(_modules_under(kernels, KERNELS_PACKAGE))
    return dict(sorted(modules.items()))


def _modules_under(folder: Path, package: str) -> dict[str, Path]:
    modules = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if not all(part.isidentifier() for part in parts):
            continue  # not importable (e.g. a data folder with a dash in its name)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def scan_imports(package_root: Path | str | None = None) -> list[ImportEdge]:
    """Every import statement of every module, resolved to absolute module names."""
    modules = find_modules(package_root)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        visitor = _ImportVisitor(module, is_package(module, modules), modules)
        visitor.visit(tree)
        edges.extend(visitor.edges)
    return edges


def import_graph(
    package_root: Path | str | None = None, *, deferred: bool = True, type_checking: bool = True
) -> dict[str, set[str]]:
    """`{module: {minivllm modules it imports}}` for every module of the package.

    `deferred=False` drops imports inside functions and `type_checking=False` those under
    `if TYPE_CHECKING:`, leaving only what runs while a module is being imported.
    """
    graph: dict[str, set[str]] = {module: set() for module in find_modules(package_root)}
    for edge in scan_imports(package_root):
        if (edge.deferred and not deferred) or (edge.type_checking and not type_checking):
            continue
        if edge.imported in graph and edge.imported != edge.importer:
            graph[edge.importer].add(edge.imported)
    return graph


class _ImportVisitor(ast.NodeVisitor):
    """Collects the import statements of one module, noting when each one runs."""

    def __init__(self, module: str, package: bool, modules: dict[str, Path]) -> None:
        self.module, self.modules, self.edges = module, modules, []
        # The package that relative imports start from.
        self.package = module if package else module.rpartition(".")[0]
        self.function_depth = 0
        self.type_checking_depth = 0

    def _add(self, imported: str, lineno: int) -> None:
        edge = ImportEdge(
            self.module, imported, lineno, self.function_depth > 0, self.type_checking_depth > 0
        )
        if edge not in self.edges:  # `from x import a, b` names x once, not twice
            self.edges.append(edge)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._resolve_base(node)
        for alias in node.names:
            # `from pkg import name`: name is a submodule if such a module exists, otherwise an
            # attribute defined in pkg/__init__.py.
            candidate = f"{base}.{alias.name}"
            self._add(candidate if candidate in self.modules else base, node.lineno)

    def _resolve_base(self, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        parts = self.package.split(".")
        anchor = ".".join(parts[: len(parts) - (node.level - 1)])
        return f"{anchor}.{node.module}" if node.module else anchor

    def _visit_function(self, node: ast.AST) -> None:
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_checking_depth += 1
            for statement in node.body:
                self.visit(statement)
            self.type_checking_depth -= 1
            for statement in node.orelse:
                self.visit(statement)
        else:
            self.generic_visit(node)


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def source_path(module: str, package: bool = False) -> str:
    """Where a learner finds `module` in this repository: "minivllm/core/scheduler.py",
    "kernels/reference.py" (the `minivllm.kernels` package is the top-level folder)."""
    parts = module.split(".")
    if module == KERNELS_PACKAGE or module.startswith(KERNELS_PACKAGE + "."):
        parts = parts[1:]
    return "/".join(parts) + ("/__init__.py" if package else ".py")


# ---------------------------------------------------------------------------------------------
# Drawing the graph.

_BOX_WIDTH, _BOX_HEIGHT = 0.95, 0.62  # in units of one column and one row
_NAME_FONTSIZE, _VLLM_FONTSIZE, _LAYER_FONTSIZE = 6, 5.5, 8
_TINT = 0.25  # box fill: this much of the layer colour on white, opaque so arrows pass behind
_SAME_LINE_ARC_HEIGHT = 0.3
_MAX_COLUMNS = 5  # a layer with more modules than this wraps onto a second line
_INCHES_PER_COLUMN, _INCHES_PER_LINE = 3.3, 0.85  # one column fits a 50-character path


def collapse_to_layers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of `LAYERS` prefixes ("minivllm.core", "minivllm.sequence", ...): one node per
    prefix that some module falls under, an edge where any of its modules imports another's."""
    unit = {module: _unit_of(module) for module in graph}
    collapsed: dict[str, set[str]] = {u: set() for u in unit.values()}
    for module, imported in graph.items():
        collapsed[unit[module]].update(unit[m] for m in imported if unit[m] != unit[module])
    return collapsed


def _unit_of(module: str) -> str:
    match = _longest_prefix(module)
    return match[1] if match else module


def row_of(module: str) -> int:
    """Which entry of `ROWS` the module's layer sits in (unlisted modules go to the bottom)."""
    layer = layer_of(module)
    return next((i for i, row in enumerate(ROWS) if layer in row), len(ROWS) - 1)


def layout(
    graph: dict[str, set[str]], max_columns: int = _MAX_COLUMNS
) -> dict[str, tuple[float, float]]:
    """Box centres `{module: (x, y)}`: one band per entry of `ROWS` from the top (y = 0) down
    (negative y). A layer's modules sit side by side, wrapping after `max_columns` boxes;
    small layers of one band share a line when they fit (core beside the simulator)."""
    bands: list[dict[str, list[str]]] = [{} for _ in ROWS]
    for module in sorted(graph, key=_layer_order_key):
        bands[row_of(module)].setdefault(layer_of(module), []).append(module)
    lines: list[list[str]] = []
    for band in bands:
        band_lines: list[list[str]] = []
        for modules in band.values():
            for start in range(0, len(modules), max_columns):
                chunk = modules[start : start + max_columns]
                if band_lines and len(band_lines[-1]) + len(chunk) <= max_columns:
                    band_lines[-1].extend(chunk)
                else:
                    band_lines.append(list(chunk))
        lines.extend(band_lines)
    return {
        module: (column - (len(line) - 1) / 2, -float(line_index))
        for line_index, line in enumerate(lines)
        for column, module in enumerate(line)
    }


def _layer_order_key(module: str) -> tuple[int, str]:
    order = list(LAYERS)
    layer = layer_of(module)
    return (order.index(layer) if layer in order else len(order), module)


def suggested_figsize(
    graph: dict[str, set[str]] | None = None, *, level: str = "module"
) -> tuple[float, float]:
    """A figure size (inches) at which every label of `draw_architecture(ax, graph, level=...)`
    fits its box."""
    positions = layout(_graph_to_draw(graph, level)[0])
    xs = [x for x, _ in positions.values()] or [0.0]
    ys = [y for _, y in positions.values()] or [0.0]
    columns = max(xs) - min(xs) + 1 + 1  # one extra column on the left for the layer names
    return columns * _INCHES_PER_COLUMN, (max(ys) - min(ys) + 1) * _INCHES_PER_LINE


def _graph_to_draw(
    graph: dict[str, set[str]] | None, level: str
) -> tuple[dict[str, set[str]], set[str]]:
    if level not in ("module", "layer"):
        raise ValueError(f"level must be 'module' or 'layer', got {level!r}.")
    graph = import_graph() if graph is None else graph
    packages = packages_in(graph)
    graph = collapse_to_layers(graph) if level == "layer" else drop_empty_packages(graph, packages)
    return graph, packages


def draw_architecture(ax, graph: dict[str, set[str]] | None = None, *, level: str = "module"):
    """Draw minivllm's import graph on `ax`, layer by layer: entry points at the top, kernels
    and then the shared data types at the bottom. Each box names the minivllm file and, in grey
    below it, the vLLM file it mirrors ("—": no counterpart). Arrows point from importer to
    imported; an arrow into a higher layer breaks the layering and is drawn in the alarm colour.

    `level="module"`: one box per module (package `__init__`s that import nothing and that
    nobody imports by name are left out); `level="layer"`: one box per sub-package.
    Returns `{node: (x, y)}`, the box centres. Size the figure with `suggested_figsize`.
    """
    graph, packages = _graph_to_draw(graph, level)
    positions = layout(graph)
    for module, imported in graph.items():
        for target in sorted(imported):
            upward = row_of(target) < row_of(module)
            _draw_edge(ax, positions[module], positions[target], upward)
    for module, (x, y) in positions.items():
        label = source_path(module, module in packages)
        if level == "layer" and module in packages and module != PACKAGE:
            label = label.removesuffix("__init__.py")  # "minivllm/core/": the sub-package
        _draw_box(ax, x, y, label, vllm_path(module) or "—", request_color(row_of(module)))
    _label_bands(ax, positions)
    _frame(ax, positions)
    return positions


def packages_in(graph: dict[str, set[str]]) -> set[str]:
    """Modules that are packages: they have sub-modules in `graph`, or are packages on disk."""
    on_disk = {m for m, path in find_modules().items() if path.name == "__init__.py"}
    return {m for m in graph if m in on_disk or any(o.startswith(m + ".") for o in graph)}


def drop_empty_packages(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """`graph` without package `__init__`s that import nothing and that nobody imports by
    name (empty markers such as `minivllm/worker/__init__.py`)."""
    imported_anywhere = set().union(*graph.values()) if graph else set()
    keep = {m for m in graph if m not in packages or graph[m] or m in imported_anywhere}
    return {m: graph[m] & keep for m in graph if m in keep}


def _draw_box(ax, x: float, y: float, name: str, vllm: str, color: str) -> None:
    box = FancyBboxPatch(
        (x - _BOX_WIDTH / 2, y - _BOX_HEIGHT / 2),
        _BOX_WIDTH,
        _BOX_HEIGHT,
        boxstyle="round,pad=0.01,rounding_size=0.06",
        facecolor=_tint(color),
        edgecolor=COLORS["edge"],
        linewidth=0.8,
        zorder=2,
    )
    ax.add_patch(box)
    ax.text(x, y + 0.11, name, ha="center", va="center", fontsize=_NAME_FONTSIZE,
            weight="bold", zorder=3)
    ax.text(x, y - 0.14, vllm, ha="center", va="center", fontsize=_VLLM_FONTSIZE,
            color="#555555", style="italic", zorder=3)


def _tint(color: str) -> tuple[float, float, float]:
    return tuple(_TINT * c + (1 - _TINT) for c in to_rgb(color))


def _draw_edge(ax, start: tuple[float, float], end: tuple[float, float], upward: bool) -> None:
    (x0, y0), (x1, y1) = start, end
    half = _BOX_HEIGHT / 2
    if y0 == y1:  # same line: a low arc over the boxes between (rad is relative to length)
        rad = _SAME_LINE_ARC_HEIGHT / abs(x1 - x0) * (1 if x1 > x0 else -1)
        tail, head, curve = (x0, y0 + half), (x1, y1 + half), f"arc3,rad={rad:.3f}"
    else:
        down = y1 < y0
        tail = (x0, y0 - half if down else y0 + half)
        head = (x1, y1 + half if down else y1 - half)
        curve = "arc3,rad=0.0"
    ax.annotate(
        "",
        xy=head,
        xytext=tail,
        arrowprops=dict(
            arrowstyle="-|>",
            color=COLORS["copied"] if upward else COLORS["edge"],
            alpha=0.9 if upward else 0.25,
            linewidth=1.4 if upward else 0.6,
            shrinkA=0,
            shrinkB=0,
            connectionstyle=curve,
        ),
        zorder=1,
    )


def _label_bands(ax, positions: dict[str, tuple[float, float]]) -> None:
    """Name the layers of each band at the left edge."""
    left = min((x for x, _ in positions.values()), default=0.0) - 1.0
    first_line: dict[int, float] = {}
    for module, (_, y) in positions.items():
        first_line[row_of(module)] = max(first_line.get(row_of(module), y), y)
    for row, y in first_line.items():
        present = [layer for layer in ROWS[row] if any(
            layer_of(m) == layer and row_of(m) == row for m in positions)]
        ax.text(left, y, "\n".join(present), ha="left", va="center",
                fontsize=_LAYER_FONTSIZE, color=COLORS["edge"], style="italic")


def _frame(ax, positions: dict[str, tuple[float, float]]) -> None:
    xs = [x for x, _ in positions.values()] or [0.0]
    ys = [y for _, y in positions.values()] or [0.0]
    ax.set_xlim(min(xs) - 1.1, max(xs) + 0.55)
    ax.set_ylim(min(ys) - 0.5, max(ys) + 0.5)
    ax.set_axis_off()
