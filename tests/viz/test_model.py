"""Model pictures: GQA lines join each query head to its KV head; RoPE arrows keep their length."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minivllm.viz.model import (  # noqa: E402
    draw_gqa_groups,
    draw_rope_angles,
    draw_rope_rotation,
    draw_rope_wavelengths,
)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (4, 4), (4, 1)])
def test_gqa_lines_join_each_query_head_to_its_group(num_heads, num_kv_heads):
    fig, ax = plt.subplots()
    draw_gqa_groups(ax, num_heads, num_kv_heads)
    lines = [line for line in ax.lines]
    assert len(lines) == num_heads
    group_size = num_heads // num_kv_heads
    kv_x = sorted({line.get_xdata()[1] for line in lines})
    assert len(kv_x) == num_kv_heads
    for head, line in enumerate(lines):
        assert line.get_xdata()[0] == head
        assert line.get_xdata()[1] == kv_x[head // group_size]
    plt.close(fig)


def test_gqa_rejects_uneven_groups():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="multiple"):
        draw_gqa_groups(ax, 6, 4)
    plt.close(fig)


def test_rope_pictures_draw_what_they_are_given():
    inv_freq = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    fig, axes = plt.subplots(1, 3)
    draw_rope_wavelengths(axes[0], {"rope": inv_freq}, {"context": 64})
    np.testing.assert_allclose(axes[0].lines[0].get_ydata(), 2 * math.pi / inv_freq)
    table = np.cos(np.outer(np.arange(10), inv_freq))
    draw_rope_angles(axes[1], table)
    np.testing.assert_allclose(axes[1].images[0].get_array(), table)
    draw_rope_rotation(axes[2], {0: (1.0, 0.0), 3: (0.0, 1.0)})
    labels = sorted(t.get_text() for t in axes[2].texts if t.get_text())
    assert labels == ["p=0", "p=3"]
    plt.close(fig)
