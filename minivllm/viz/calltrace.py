"""Who calls whom, recorded from a real run: a profiler hook on minivllm's own Python frames.

The module diagram people ask for ("draw the dependency graph of vLLM's main modules") is a
*call* graph, not an import graph. This module records it instead of drawing it by hand:
`trace_calls(fn)` runs `fn` under `sys.setprofile`, keeps the frames whose code lives in the
minivllm package, and attributes each call to the nearest *component* (a class from
`COMPONENTS`) on the stack, so helper functions and small classes fold into the component that
owns them. `draw_call_graph` places the components (the request path down the middle, the scheduler
left, output processing right) and draws one arrow per recorded caller -> callee pair,
labelled with the methods called and how often.

    trace = trace_calls(lambda: llm.generate(["ROMEO:"], params))
    trace.edges[("LLMEngine", "Scheduler")]  # Counter({"schedule": 5, ...})

Only the calling thread is traced (`sys.setprofile`), which is the whole engine for the
single-process executor. Course tooling: the runtime knows nothing of it.
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

# minivllm/ itself (this file is minivllm/viz/calltrace.py).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Component (the class whose methods count as "the component") -> layer it is drawn in. The
# layers are the rows of the figure, top to bottom; a class defined in another module with the
# same name would be folded in too, which is fine at this level of detail.
COMPONENTS: dict[str, str] = {
    "LLM": "entrypoints",
    "LLMEngine": "engine",
    "SequenceGroupOutputProcessor": "engine",
    "Detokenizer": "engine",
    "Scheduler": "core",
    "BlockSpaceManager": "core",
    "UniProcExecutor": "executor",
    "Worker": "worker",
    "ModelRunner": "worker",
    "CacheEngine": "worker",
    "LlamaForCausalLM": "model_executor",
    "Sampler": "model_executor",
    "Attention": "attention",
}
# Where each component sits in the figure (x in [0, 1], y = row, top = 0): the request path runs
# down the middle (LLM -> engine -> executor -> worker -> model runner -> model -> attention),
# the scheduler and its block manager on the left, output processing on the right. Only the
# places are chosen here; every arrow comes from the recorded calls.
POSITIONS: dict[str, tuple[float, float]] = {
    "LLM": (0.45, 0),
    "LLMEngine": (0.45, -1.1),
    "SequenceGroupOutputProcessor": (0.8, -1.7),
    "Scheduler": (0.1, -2.2),
    "UniProcExecutor": (0.45, -2.4),
    "Detokenizer": (0.85, -3.0),
    "BlockSpaceManager": (0.1, -3.7),
    "Worker": (0.45, -3.7),
    "ModelRunner": (0.45, -5.0),
    "CacheEngine": (0.85, -4.3),
    "LlamaForCausalLM": (0.25, -6.2),
    "Sampler": (0.68, -6.2),
    "Attention": (0.25, -7.4),
}

# Calls seen only while the engine is built: drawn lighter than the per-step calls, still legible.
_SETUP_GREY = "#8C8C8C"


@dataclass
class CallTrace:
    """Calls between components: `edges[(caller, callee)]` counts the callee's methods."""

    edges: dict[tuple[str, str], collections.Counter] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # components in order of first call

    def callees(self, caller: str) -> list[str]:
        return [callee for (src, callee) in self.edges if src == caller]

    def count(self, caller: str, callee: str) -> int:
        return sum(self.edges.get((caller, callee), collections.Counter()).values())


def _component(code) -> str | None:
    owner = code.co_qualname.split(".")[0]
    # A class body runs when its module is first imported: that is not a call to the class.
    if owner not in COMPONENTS or code.co_qualname == owner:
        return None
    return owner


def trace_calls(fn: Callable[[], object], package_dir: str | None = None) -> CallTrace:
    """Run `fn()` and record which component calls which (methods and counts)."""
    root = package_dir or _PACKAGE_DIR
    skip = os.path.join(root, "viz") + os.sep  # the tooling itself is not part of the picture
    trace = CallTrace()
    stack: list[tuple[object, str | None]] = []  # (frame, component owning it)

    def on_event(frame, event, _arg):
        code = frame.f_code
        if not code.co_filename.startswith(root) or code.co_filename.startswith(skip):
            return
        if event == "call":
            owner = _component(code)
            enclosing = next((c for _, c in reversed(stack) if c), None)
            if owner and enclosing and owner != enclosing:
                edge = trace.edges.setdefault((enclosing, owner), collections.Counter())
                edge[code.co_name] += 1
            if owner and owner not in trace.order:
                trace.order.append(owner)
            stack.append((frame, owner or enclosing))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    previous = sys.getprofile()
    sys.setprofile(on_event)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return trace


def _edge_label(methods: collections.Counter, max_methods: int = 3) -> str:
    calls = collections.Counter({name: n for name, n in methods.items() if name != "__init__"})
    if not calls:
        return "creates it"
    shown = [f"{name} ×{n}" for name, n in calls.most_common(max_methods)]
    more = len(calls) - max_methods
    return ", ".join(shown) + (f", +{more} more" if more > 0 else "")


def call_graph_edges(trace: CallTrace, setup: CallTrace | None = None) -> list[tuple[str, str, str, bool]]:
    """(caller, callee, methods label, seen only in setup) for every recorded edge, numbered in
    the order the figure numbers them."""
    edges = [(a, b, _edge_label(m), False) for (a, b), m in trace.edges.items()]
    if setup is not None:
        edges += [(a, b, _edge_label(m), True) for (a, b), m in setup.edges.items() if (a, b) not in trace.edges]
    return edges


def draw_call_graph(trace: CallTrace, ax, setup: CallTrace | None = None, legend_ax=None,
                    title: str | None = None) -> None:
    """Boxes = components, solid arrows = calls recorded in `trace`, dashed grey arrows = calls
    seen only in `setup` (for example the engine's construction: profile run, cache allocation).
    Each arrow carries a number; `legend_ax` (if given) lists what each number calls, and how often."""
    from matplotlib.patches import FancyArrowPatch

    from minivllm.viz.style import COLORS

    edges = call_graph_edges(trace, setup)
    boxes = {}
    for name in {n for a, b, _, _ in edges for n in (a, b)}:
        x, y = POSITIONS[name]
        boxes[name] = ax.text(x, y, f"{name}\n{COMPONENTS[name]}", ha="center", va="center", fontsize=10,
                              zorder=3, bbox=dict(boxstyle="round,pad=0.4", facecolor=COLORS["free"],
                                                  edgecolor=COLORS["edge"]))
    for number, (caller, callee, _, setup_only) in enumerate(edges, start=1):
        (x0, y0), (x1, y1) = POSITIONS[caller], POSITIONS[callee]
        color = _SETUP_GREY if setup_only else COLORS["edge"]
        start, end = _box_edge((x0, y0), (x1, y1), caller), _box_edge((x1, y1), (x0, y0), callee)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color=color, zorder=2,
                                     linewidth=1.2, linestyle="--" if setup_only else "-", shrinkA=0, shrinkB=0))
        # The number sits halfway along the visible segment, clear of both boxes and the arrowhead.
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2, str(number), fontsize=8, ha="center", va="center",
                zorder=4, color="white", bbox=dict(boxstyle="circle,pad=0.2", facecolor=color, edgecolor="none"))
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-7.9, 0.4)
    ax.axis("off")
    ax.set_title(title or "who calls whom: LLM.generate recorded (solid), LLM(...) (dashed)", fontsize=11, loc="left")
    if legend_ax is not None:
        _draw_edge_legend(legend_ax, edges)


def _box_edge(center, toward, name) -> tuple[float, float]:
    """Where the segment from `center` toward `toward` leaves `name`'s box (estimated in data
    units from the label's length), so arrows start and end at the outlines, heads visible."""
    half_w, half_h = 0.0052 * max(len(name), 12) + 0.014, 0.27
    dx, dy = toward[0] - center[0], toward[1] - center[1]
    t = min(half_w / abs(dx) if dx else float("inf"), half_h / abs(dy) if dy else float("inf"))
    return center[0] + t * dx, center[1] + t * dy


def _draw_edge_legend(ax, edges) -> None:
    lines = [f"{i:>2}  {a} → {b}\n      {label}" for i, (a, b, label, _) in enumerate(edges, start=1)]
    ax.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=8.5, family="monospace", transform=ax.transAxes)
    ax.axis("off")


def record_llm_generate(make_llm: Callable[[], object], prompts=("ROMEO:", "JULIET:"),
                        max_tokens: int = 4) -> tuple[CallTrace, CallTrace]:
    """Trace `make_llm()` (the setup, e.g. `lambda: LLM(seed=0)`) and one greedy `generate`.

    The caller builds the `LLM`: course tooling sits below the entry points in the layer map."""
    from minivllm.sampling_params import SamplingParams

    built = {}
    setup = trace_calls(lambda: built.setdefault("llm", make_llm()))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    run = trace_calls(lambda: built["llm"].generate(list(prompts), params, use_tqdm=False))
    return run, setup


def figure(run: CallTrace, setup: CallTrace | None = None):
    """The call graph with its numbered legend, as one matplotlib figure (100 dpi)."""
    import matplotlib.pyplot as plt

    fig, (ax, legend_ax) = plt.subplots(1, 2, figsize=(16, 9.5), dpi=100, gridspec_kw=dict(width_ratios=[1.4, 1]))
    draw_call_graph(run, ax, setup=setup, legend_ax=legend_ax)
    fig.tight_layout()
    return fig
