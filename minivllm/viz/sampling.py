"""Pictures of sampling: what each logits processor keeps, and what forking saves.

Pure drawing functions (state in, an Axes to draw on, nothing returned):

    draw_token_distribution(ax, probs, kept)   the most likely tokens' probabilities; the
                                               ones a filter removed are greyed out
    draw_memory_saving(ax, results)            KV blocks with and without sharing, per
                                               workload, labelled with the saving in %
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from minivllm.viz.style import COLORS

_BAR_WIDTH = 0.38
_FONT = 8


def draw_token_distribution(
    ax,
    probs: Sequence[float],
    kept: Sequence[bool] | None = None,
    labels: Sequence[str] | None = None,
    top: int = 16,
    title: str | None = None,
) -> None:
    """Bars of the `top` most likely tokens (by `probs`), kept ones in the decode colour.

    Args:
        probs: probability per token id (a row of softmax(logits)).
        kept: per token id, whether the filter kept it (default: all kept).
        labels: per token id, the text to print under its bar (default: the id).
    """
    probs = np.asarray(probs, dtype=float)
    order = np.argsort(-probs, kind="stable")[:top]
    kept_mask = np.ones_like(probs, dtype=bool) if kept is None else np.asarray(kept, dtype=bool)
    colors = [COLORS["generated"] if kept_mask[t] else COLORS["idle"] for t in order]
    ax.bar(range(len(order)), probs[order], color=colors, edgecolor=COLORS["edge"], linewidth=0.5)
    names = [repr(labels[t])[1:-1] if labels is not None else str(t) for t in order]
    ax.set_xticks(range(len(order)), names, rotation=60, fontsize=_FONT)
    ax.set_ylabel("probability")
    if title:
        ax.set_title(title, fontsize=9)


def draw_memory_saving(ax, results: Mapping[str, tuple[float, float]], ylabel: str = "KV blocks") -> None:
    """Grouped bars per workload: (blocks without sharing, blocks with sharing), and the saving.

    Args:
        results: workload name -> (blocks if every sample held its own copy, blocks used with
            fork + copy-on-write).
    """
    names = list(results)
    x = np.arange(len(names))
    separate = [results[n][0] for n in names]
    shared = [results[n][1] for n in names]
    ax.bar(x - _BAR_WIDTH / 2, separate, _BAR_WIDTH, color=COLORS["used"], label="one copy per sequence")
    ax.bar(x + _BAR_WIDTH / 2, shared, _BAR_WIDTH, color=COLORS["shared"], label="shared (fork + CoW)")
    for i, (s, f) in enumerate(zip(separate, shared)):
        ax.text(i + _BAR_WIDTH / 2, f, f"-{(1 - f / s) * 100:.0f}%", ha="center", va="bottom", fontsize=_FONT)
    ax.set_xticks(x, names, fontsize=_FONT)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=_FONT, frameon=False)
