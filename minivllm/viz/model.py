"""Pictures of the model's two position-and-head ideas: rotary embeddings and grouped-query
attention. Pure drawing functions: state in (plain numbers or arrays), an `Axes` out.

    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> draw_gqa_groups(ax, num_heads=8, num_kv_heads=2)
    >>> plt.close(fig)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from minivllm.viz.style import COLORS, request_color

_BOX = 0.8  # width/height of a head's box, in head slots


def draw_rope_wavelengths(ax, inv_freqs: Mapping[str, Sequence[float]],
                          context_marks: Mapping[str, float] | None = None) -> None:
    """Wavelength (tokens per full turn, 2*pi / inv_freq) of each feature pair, log scale.

    `inv_freqs`: label -> inv_freq [head_dim // 2] (e.g. plain RoPE vs Llama 3 scaling).
    `context_marks`: label -> a token count drawn as a horizontal line (e.g. the training
    context): pairs above it never complete a turn within that context.
    """
    for index, (label, inv_freq) in enumerate(inv_freqs.items()):
        wavelengths = 2 * math.pi / np.asarray(inv_freq, dtype=float)
        ax.plot(np.arange(len(wavelengths)), wavelengths, marker="o", markersize=3,
                color=request_color(index), label=label)
    for label, tokens in (context_marks or {}).items():
        ax.axhline(tokens, color=COLORS["edge"], linestyle="--", linewidth=1)
        ax.annotate(label, (0, tokens), textcoords="offset points", xytext=(2, 3), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("feature pair i (pairs x[i], x[i + d/2])")
    ax.set_ylabel("wavelength (tokens per turn)")
    ax.legend(loc="upper left", fontsize=8)


def draw_rope_angles(ax, cos_table: np.ndarray) -> None:
    """Heatmap of cos(position * inv_freq[i]): rows are positions, columns feature pairs.

    Fast pairs (left) flicker from token to token: they encode local order. Slow pairs (right)
    barely move: they tell far-apart positions apart.
    """
    table = np.asarray(cos_table, dtype=float)
    image = ax.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("feature pair i")
    ax.set_ylabel("position")
    ax.figure.colorbar(image, ax=ax, label="cos(angle)")


def draw_rope_rotation(ax, vectors: Mapping[int, tuple[float, float]], title: str = "") -> None:
    """One feature pair of one query, as an arrow per position (the same vector, rotated).

    `vectors`: position -> the rotated pair (x_i, x_{i + d/2}). The length never changes:
    RoPE only turns the pair, by an angle proportional to the position.
    """
    radius = max(math.hypot(*v) for v in vectors.values())
    circle = np.linspace(0, 2 * math.pi, 100)
    ax.plot(radius * np.cos(circle), radius * np.sin(circle), color=COLORS["idle"], linewidth=1)
    for index, (position, (x, y)) in enumerate(vectors.items()):
        ax.annotate("", xy=(x, y), xytext=(0, 0),
                    arrowprops=dict(arrowstyle="->", color=request_color(index), linewidth=1.5))
        ax.annotate(f"p={position}", (x, y), fontsize=8, color=request_color(index),
                    textcoords="offset points", xytext=(3, 3))
    limit = 1.3 * radius
    ax.set_xlim(-limit, limit)
    ax.set_ylim(-limit, limit)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)


def draw_gqa_groups(ax, num_heads: int, num_kv_heads: int) -> None:
    """Query heads (top row) joined to the key/value head they read (bottom row).

    With num_kv_heads == num_heads this is multi-head attention; with one KV head it is
    multi-query attention; in between, grouped-query attention.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    group_size = num_heads // num_kv_heads
    kv_x = [(g + 0.5) * group_size - 0.5 for g in range(num_kv_heads)]  # centred under its group
    for head in range(num_heads):
        group = head // group_size
        ax.plot([head, kv_x[group]], [1, 0], color=request_color(group), linewidth=1, zorder=1)
        _box(ax, head, 1, f"q{head}", request_color(group))
    for group, x in enumerate(kv_x):
        _box(ax, x, 0, f"kv{group}", request_color(group))
    ax.set_xlim(-1, num_heads)
    ax.set_ylim(-0.7, 1.7)
    ax.set_yticks([0, 1], ["K/V heads\n(cached)", "query heads"])
    ax.set_xticks([])
    ax.set_title(f"{num_heads} query heads, {num_kv_heads} KV heads: "
                 f"{group_size} query heads share each cached K/V", fontsize=9)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def _box(ax, x: float, y: float, label: str, color: str) -> None:
    ax.add_patch(_rectangle(x - _BOX / 2, y - _BOX / 4, _BOX, _BOX / 2, color))
    ax.text(x, y, label, ha="center", va="center", fontsize=7, color="white", zorder=3)


def _rectangle(x, y, width, height, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, facecolor=color, edgecolor=COLORS["edge"], zorder=2)
