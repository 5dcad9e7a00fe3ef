"""The layer map (notebook 00's first picture): every layer with modules is on it, every arrow is
a call the source really makes and the rules allow, and no two boxes overlap."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm.viz import archmap, layermap  # noqa: E402
from minivllm.viz.layers import CALLS, LAYER_ROLES, LAYERS, MAY_IMPORT, layer_of  # noqa: E402


def _layer_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, imported in archmap.import_graph().items():
        graph.setdefault(layer_of(module), set()).update(layer_of(m) for m in imported)
    return graph


def test_roles_name_real_layers_and_every_populated_layer_is_on_the_map():
    assert set(LAYER_ROLES) <= set(LAYERS)
    populated = {layer_of(m) for m in archmap.find_modules()} - {"package"}
    assert set(layermap.map_layers()) == populated


def test_every_call_is_an_allowed_import_the_source_makes():
    graph = _layer_graph()
    for caller, callee, call in CALLS:
        assert callee in MAY_IMPORT[caller], f"{caller} -> {callee} ({call}) breaks the layering"
        assert callee in graph[caller], f"{caller} imports nothing of {callee}, yet the map says it calls {call}"


def test_the_request_path_runs_down_one_column():
    positions = layermap.layer_positions()
    path = ["entrypoints", "engine", "executor", "worker", "model_executor", "attention", "kernels"]
    assert len({positions[layer][0] for layer in path}) == 1
    ys = [positions[layer][1] for layer in path]
    assert ys == sorted(ys, reverse=True) and len(set(ys)) == len(ys)


def test_draw_layer_map_draws_one_box_per_layer_and_one_arrow_per_call():
    fig, ax = plt.subplots(figsize=layermap.LAYER_MAP_FIGSIZE)
    positions = layermap.draw_layer_map(ax)
    texts = [t.get_text() for t in ax.texts]
    plt.close(fig)
    assert set(positions) == set(layermap.map_layers())
    assert len(ax.patches) == len(positions)
    assert len([t for t in texts if t == ""]) == len(CALLS)  # annotate() arrows carry no text
    assert "minivllm/core/" in texts and "vLLM: vllm/worker/, vllm/spec_decode/" in texts
    boxes = sorted(positions.values())
    for i, (x0, y0) in enumerate(boxes):
        for x1, y1 in boxes[i + 1:]:
            assert abs(x0 - x1) >= layermap._BOX_WIDTH or abs(y0 - y1) >= layermap._BOX_HEIGHT
