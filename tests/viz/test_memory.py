"""The memory-waste bars: each bar's segments are the breakdown's shares of allocated slots."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minivllm.viz.memory import WASTE_CATEGORIES, draw_memory_waste, waste_percentages  # noqa: E402
from minivllm.viz.style import COLORS  # noqa: E402


def test_waste_percentages_normalise_each_breakdown():
    shares = waste_percentages({"token states": 30, "reservation": 10, "internal fragmentation": 60})
    assert shares == pytest.approx(
        {"token states": 30.0, "reservation": 10.0, "internal fragmentation": 60.0}
    )
    assert waste_percentages({"token states": 3})["token states"] == 100.0


@pytest.mark.parametrize("bad", [{"token states": 0}, {"external": 1, "token states": 1}])
def test_waste_percentages_reject_bad_breakdowns(bad):
    with pytest.raises(ValueError):
        waste_percentages(bad)


def test_draw_memory_waste_bar_segments_match_the_shares():
    breakdowns = {
        "reserve max length": {"token states": 20, "reservation": 15, "internal fragmentation": 65},
        "paged": {"token states": 96, "reservation": 3, "internal fragmentation": 1},
    }
    fig, ax = plt.subplots()
    draw_memory_waste(ax, breakdowns, paper_token_states={"reserve max length": 20.4})
    plt.close(fig)
    bars = ax.patches
    assert len(bars) == len(breakdowns) * len(WASTE_CATEGORIES)
    top_bar = [b for b in bars if b.get_y() + b.get_height() / 2 == pytest.approx(1.0)]
    assert [round(b.get_width(), 6) for b in top_bar] == [20.0, 15.0, 65.0]
    assert to_rgba(top_bar[0].get_facecolor())[:3] == to_rgba(COLORS["used"])[:3]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["paged", "reserve max length"]
    ticks = [line for line in ax.lines if line.get_label() == "paper: token states"]
    assert len(ticks) == 1 and list(ticks[0].get_xdata()) == [20.4, 20.4]
