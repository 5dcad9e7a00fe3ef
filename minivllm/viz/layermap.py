"""The layer map: minivllm at a glance, one box per layer and one arrow per call down the stack.

Where `minivllm.viz.archmap` draws every import, this draws what a newcomer needs first: each
layer's folder, what it holds and the vLLM folder it mirrors (`LAYER_ROLES`, `LAYERS`,
`VLLM_PATHS`), and the calls that carry a request from `LLM.generate` to the kernels (`CALLS`).
The request's path runs down the middle column; the scheduler sits to its left, the layers
beside the stack (course tooling, KV connectors, collectives) to its right, and the data
every layer shares is the band at the bottom.

    >>> fig, ax = plt.subplots(figsize=LAYER_MAP_FIGSIZE)
    >>> boxes = draw_layer_map(ax)   # {layer: (x, y)} box centres
"""

from __future__ import annotations

from matplotlib.colors import to_rgb
from matplotlib.patches import FancyBboxPatch

from minivllm.viz.archmap import find_modules, source_path
from minivllm.viz.layers import CALLS, LAYER_ROLES, LAYERS, ROWS, VLLM_PATHS, layer_of
from minivllm.viz.style import COLORS, request_color

LAYER_MAP_FIGSIZE = (12.0, 10.0)
# Columns: the scheduler left of the request's path, the side layers right of it.
_COLUMN = {"core": -1, "labs": -1, "viz": 1, "kv_transfer": 1, "distributed": 1}
_BOX_WIDTH, _BOX_HEIGHT, _COLUMN_STEP, _ROW_STEP = 3.3, 0.95, 3.6, 1.25
_TINT = 0.3  # box fill: this much of the layer colour on white


def map_layers() -> list[str]:
    """The layers on the map: those with a role and at least one module, top to bottom."""
    present = {layer_of(module) for module in find_modules()}
    return [layer for row in ROWS for layer in row if layer in LAYER_ROLES and layer in present]


def layer_positions() -> dict[str, tuple[float, float]]:
    """Box centres `{layer: (x, y)}`: rows of `ROWS` from the top down, shared rows side by side
    (the foundation band is centred under the whole map)."""
    rows = [row for row in ROWS if any(layer in map_layers() for layer in row)]
    positions = {}
    for index, row in enumerate(rows):
        for layer in row:
            if layer in map_layers():
                positions[layer] = (_COLUMN.get(layer, 0) * _COLUMN_STEP, -index * _ROW_STEP)
    return positions


def folders(layer: str) -> str:
    """Where a layer lives: its folders ("minivllm/worker/  minivllm/spec_decode/"); the shared
    data modules by their paths under minivllm/."""
    modules = find_modules()
    paths = []
    for prefix in LAYERS[layer]:
        if prefix not in modules:
            continue
        package = modules[prefix].name == "__init__.py"
        if layer == "foundation":
            path = source_path(prefix, package).removeprefix("minivllm/")
            paths.append(path.removesuffix("__init__.py"))
        elif package:
            paths.append(source_path(prefix, package).removesuffix("__init__.py"))
    return "  ".join(paths)


def vllm_folders(layer: str) -> str:
    """The vLLM (v0) folders or files the layer's prefixes mirror ("—": none)."""
    paths = [VLLM_PATHS[prefix] for prefix in LAYERS[layer] if prefix in VLLM_PATHS]
    return "vLLM: " + ", ".join(paths) if paths else "vLLM: —"


def draw_layer_map(ax) -> dict[str, tuple[float, float]]:
    """Draw the layer map on `ax` (size its figure `LAYER_MAP_FIGSIZE`); returns the box centres.

    Each box: the layer, its folders, what it holds and, in grey, the vLLM folder it mirrors.
    Each arrow: one call of `CALLS`, caller above callee, labelled with the call (dashed: the
    course tooling observing the engine from outside).
    """
    positions = layer_positions()
    rows = sorted({y for _, y in positions.values()}, reverse=True)
    for layer, (x, y) in positions.items():
        width = 2 * _COLUMN_STEP + _BOX_WIDTH if layer == "foundation" else _BOX_WIDTH
        fill = COLORS["idle"] if layer == "foundation" else _tint(request_color(rows.index(y)))
        _draw_box(ax, x, y, width, layer, fill)
    for caller, callee, call in CALLS:
        if caller in positions and callee in positions:
            _draw_call(ax, positions[caller], positions[callee], call, dashed=caller == "viz")
    xs = [x for x, _ in positions.values()]
    ys = [y for _, y in positions.values()]
    ax.set_xlim(min(xs) - _COLUMN_STEP / 2 - 0.05, max(xs) + _COLUMN_STEP / 2 + 0.05)
    ax.set_ylim(min(ys) - _ROW_STEP / 2, max(ys) + _ROW_STEP / 2)
    ax.set_axis_off()
    return positions


def _draw_box(ax, x: float, y: float, width: float, layer: str, fill) -> None:
    ax.add_patch(FancyBboxPatch(
        (x - width / 2, y - _BOX_HEIGHT / 2), width, _BOX_HEIGHT,
        boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=fill,
        edgecolor=COLORS["edge"], linewidth=0.9, zorder=2,
    ))
    lines = [  # (text, vertical offset from the centre, style)
        (layer, 0.31, dict(fontsize=10, weight="bold")),
        (folders(layer), 0.11, dict(fontsize=7.5, family="monospace")),
        (LAYER_ROLES[layer], -0.09, dict(fontsize=8.5)),
        (vllm_folders(layer), -0.3, dict(fontsize=7.5, color="#555555", style="italic")),
    ]
    for text, offset, style in lines:
        ax.text(x, y + offset, text, ha="center", va="center", zorder=3, **style)


def _draw_call(ax, start, end, call: str, dashed: bool) -> None:
    """An arrow from the caller's box to the callee's: straight down the request's path; out of
    the caller's side into the callee's top when the callee sits further out; out of the
    caller's bottom into the callee's side when it sits further in."""
    (x0, y0), (x1, y1) = start, end
    half_w, half_h = _BOX_WIDTH / 2, _BOX_HEIGHT / 2
    if x0 == x1:
        tail, head = (x0, y0 - half_h), (x1, y1 + half_h)
    elif abs(x1) > abs(x0):
        direction = 1 if x1 > x0 else -1
        tail, head = (x0 + direction * half_w, y0 - half_h / 2), (x1 - direction * half_w / 2, y1 + half_h)
    else:
        direction = 1 if x1 > x0 else -1
        tail, head = (x0 + direction * half_w / 2, y0 - half_h), (x1 - direction * half_w, y1)
    ax.annotate("", xy=head, xytext=tail, zorder=1, arrowprops=dict(
        arrowstyle="-|>", color=COLORS["edge"], linewidth=1.3,
        linestyle="--" if dashed else "-", shrinkA=0, shrinkB=0))
    mid_x, mid_y = (tail[0] + head[0]) / 2, (tail[1] + head[1]) / 2
    ax.text(mid_x + 0.08, mid_y, call, ha="left", va="center", fontsize=8.5, color=COLORS["used"],
            zorder=4, bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))


def _tint(color: str) -> tuple[float, float, float]:
    return tuple(_TINT * c + (1 - _TINT) for c in to_rgb(color))
