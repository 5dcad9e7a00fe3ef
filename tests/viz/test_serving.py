"""`draw_request_timeline`: one row per request, the TTFT span and the decode span where they belong."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from minivllm.viz.serving import RequestTimeline, draw_request_timeline


def test_spans_follow_the_token_times():
    timelines = [
        RequestTimeline(arrival=10.0, token_times=[10.5, 10.6, 10.7], label="a"),
        RequestTimeline(arrival=10.2, token_times=[10.4], aborted=True, label="b"),
    ]
    fig, ax = plt.subplots()
    draw_request_timeline(ax, timelines)
    bars = [(round(p.get_x(), 6), round(p.get_width(), 6), round(p.get_y() + p.get_height() / 2, 6)) for p in ax.patches]
    plt.close(fig)
    # Request "a" is the top row (y=1): waiting 0 -> 0.5 s, decoding 0.5 -> 0.7 s; "b" is y=0.
    assert (0.0, 0.5, 1.0) in bars and (0.5, 0.2, 1.0) in bars
    assert (0.2, 0.2, 0.0) in bars
    assert [t.get_text() for t in ax.get_yticklabels()] == ["b", "a"]
    assert timelines[0].ttft == pytest.approx(0.5)


def test_needs_a_request():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError):
        draw_request_timeline(ax, [])
    plt.close(fig)
