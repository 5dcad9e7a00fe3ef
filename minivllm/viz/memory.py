"""Where KV-cache memory goes: token states vs reservation vs fragmentation, one bar per scheme.

The categories are those of the PagedAttention paper (Kwon et al., SOSP 2023, Fig. 2):

    token states            slots holding a K/V that attention reads right now
    reservation             slots held now for tokens the request will generate later
    internal fragmentation  slots allocated but never used (the request ended first)

    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> draw_memory_waste(ax, {"paged": {"token states": 97, "reservation": 2,
    ...                                  "internal fragmentation": 1}})
    >>> plt.close(fig)
"""

from __future__ import annotations

from collections.abc import Mapping

from minivllm.viz.style import COLORS

WASTE_CATEGORIES = ("token states", "reservation", "internal fragmentation")
_CATEGORY_COLORS = {
    "token states": COLORS["used"],
    "reservation": COLORS["generated"],  # slots waiting for tokens not generated yet
    "internal fragmentation": COLORS["idle"],  # the project's colour for wasted memory
}
_PERCENT = 100.0
_MIN_LABELLED_PERCENT = 6.0  # narrower segments stay unlabelled to keep text readable


def waste_percentages(breakdown: Mapping[str, float]) -> dict[str, float]:
    """Each category as a percentage of all allocated slots (the three sum to 100)."""
    unknown = set(breakdown) - set(WASTE_CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; use {WASTE_CATEGORIES}.")
    total = sum(breakdown.get(c, 0.0) for c in WASTE_CATEGORIES)
    if total <= 0:
        raise ValueError("a breakdown needs a positive number of allocated slots.")
    return {c: _PERCENT * breakdown.get(c, 0.0) / total for c in WASTE_CATEGORIES}


def draw_memory_waste(
    ax,
    breakdowns: Mapping[str, Mapping[str, float]],
    paper_token_states: Mapping[str, float] | None = None,
) -> None:
    """One horizontal 100 % bar per scheme (first scheme on top), split into the categories.

    `breakdowns`: scheme name -> {category: slots} (any unit; each bar is normalised).
    `paper_token_states`: scheme name -> the paper's token-state percentage, drawn as a black
    tick on that bar so measured and published numbers can be compared at a glance.
    """
    names = list(breakdowns)
    paper_label = "paper: token states"
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        left = 0.0
        for category, percent in waste_percentages(breakdowns[name]).items():
            ax.barh(y, percent, left=left, color=_CATEGORY_COLORS[category],
                    edgecolor=COLORS["edge"], linewidth=0.5,
                    label=category if row == 0 else None)
            if percent >= _MIN_LABELLED_PERCENT:
                text_color = "white" if category == "token states" else COLORS["edge"]
                ax.text(left + percent / 2, y, f"{percent:.1f}%", ha="center", va="center",
                        fontsize=8, color=text_color)
            left += percent
        if paper_token_states and name in paper_token_states:
            x = paper_token_states[name]
            ax.plot([x, x], [y - 0.42, y + 0.42], color="black", linewidth=2, label=paper_label)
            paper_label = None  # one legend entry
    ax.set_yticks(range(len(names)), names[::-1])
    ax.set_xlim(0, _PERCENT)
    ax.set_xlabel("share of allocated KV-cache slots (%)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False,
              fontsize=8)
