"""Continuous batching as the clients see it: one row per request, one dot per streamed token.

    arrival        first token                      last token
       |─────────────●──●──●──●──●──●──●──●──●──●──●
       └── TTFT ─────┘└─ TPOT ┘

The span before the first token (queueing + prefill, the time to first token) is drawn in
the prompt colour, the decode span in the generated colour, and a request the client
abandoned ends in a cross. Rows that overlap in time were batched together by the engine.

    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> draw_request_timeline(ax, [RequestTimeline(arrival=0.0, token_times=[0.2, 0.3, 0.4])])
    >>> plt.close(fig)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from minivllm.viz.style import COLORS

_BAR_HEIGHT = 0.5
_DOT_SIZE = 9


@dataclass
class RequestTimeline:
    """When one request arrived and when each of its tokens reached the client (seconds)."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    aborted: bool = False
    label: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None


def draw_request_timeline(ax, timelines: Sequence[RequestTimeline], t0: float | None = None) -> None:
    """One row per request (first on top); times relative to `t0` (default: the first arrival)."""
    if not timelines:
        raise ValueError("draw_request_timeline needs at least one request.")
    t0 = min(t.arrival for t in timelines) if t0 is None else t0
    for row, timeline in enumerate(timelines):
        y = len(timelines) - 1 - row
        start = timeline.arrival - t0
        times = [t - t0 for t in timeline.token_times]
        first = times[0] if times else start
        ax.barh(y, first - start, left=start, height=_BAR_HEIGHT, color=COLORS["prompt"], alpha=0.6)
        if times:
            ax.barh(y, times[-1] - first, left=first, height=_BAR_HEIGHT, color=COLORS["generated"], alpha=0.4)
            ax.scatter(times, [y] * len(times), s=_DOT_SIZE, color=COLORS["used"], zorder=3)
        end = times[-1] if times else start
        marker, colour = ("x", COLORS["copied"]) if timeline.aborted else ("|", COLORS["finished"])
        ax.scatter([end], [y], marker=marker, s=4 * _DOT_SIZE, color=colour, zorder=4)
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels([t.label or f"request {i}" for i, t in enumerate(timelines)][::-1], fontsize=8)
    ax.set_xlabel("seconds since the first arrival")
    _legend(ax)


def _legend(ax) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=COLORS["prompt"], alpha=0.6, label="waiting + prefill (TTFT)"),
        Patch(color=COLORS["generated"], alpha=0.4, label="decoding"),
        Line2D([], [], marker="o", ls="", color=COLORS["used"], markersize=4, label="token streamed"),
        Line2D([], [], marker="x", ls="", color=COLORS["copied"], label="client left (aborted)"),
    ]
    # Above the axes, so that it never hides a row.
    ax.legend(handles=handles, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, frameon=False)
