"""The generic stepper and its small-multiples twin."""

from __future__ import annotations

import base64

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minivllm.viz.widgets import FrameStepper, draw_small_multiples, render_frame  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def draw_bars(n, ax):
    ax.bar(range(n), [1] * n)


def test_render_frame_gives_png_bytes():
    assert render_frame(3, draw_bars, (2, 2)).startswith(PNG_MAGIC)


def test_stepper_follows_slider_and_play():
    calls = []

    def draw(frame, ax):
        calls.append(frame)
        draw_bars(frame, ax)

    stepper = FrameStepper([1, 2, 3], draw, titles=["a", "b", "c"], figsize=(2, 2))
    assert (stepper.index, stepper.frame, calls) == (0, 1, [1])
    first = stepper.image.value
    stepper.slider.value = 2
    assert (stepper.index, stepper.frame, stepper.play.value) == (2, 3, 2)
    assert bytes(stepper.image.value) != bytes(first) and bytes(stepper.image.value).startswith(PNG_MAGIC)
    stepper.play.value = 1  # what pressing Play does, one tick
    assert stepper.index == 1 and stepper.frame == 2
    stepper.slider.value = 0  # cached: not drawn again
    assert bytes(stepper.image.value) == bytes(first) and calls == [1, 3, 2]
    assert (stepper.slider.max, stepper.play.max) == (2, 2)


def test_marks_list_the_frames_to_jump_to():
    stepper = FrameStepper(list(range(600)), draw_bars, figsize=(2, 2), marks={412: "swap-in", 47: "swap-out"})
    assert stepper.jump.options == (("jump to…", None), ("swap-out (47)", 47), ("swap-in (412)", 412))
    stepper.jump.value = 412
    assert (stepper.index, stepper.play.value) == (412, 412)
    assert FrameStepper([1, 2], draw_bars, figsize=(2, 2)).jump is None
    with pytest.raises(ValueError, match="outside"):
        FrameStepper([1, 2], draw_bars, marks={2: "past the end"})


def test_output_carries_key_frames_for_pages_without_a_kernel():
    from minivllm.viz.widgets import FRAMES_MIME

    marked = FrameStepper(list(range(600)), draw_bars, figsize=(2, 2), marks={412: "swap-in", 47: "swap-out"})
    marked.slider.value = 100
    saved = marked._repr_mimebundle_()[FRAMES_MIME]
    assert (saved["count"], saved["shown"]) == (600, 100)
    assert [(f["index"], f["label"]) for f in saved["frames"]] == [(47, "swap-out"), (100, "frame 100"), (412, "swap-in")]
    assert all(base64.b64decode(f["png"]).startswith(PNG_MAGIC) for f in saved["frames"])
    spread = FrameStepper(list(range(50)), draw_bars, figsize=(2, 2), titles=lambda i, f: f"t{i}").key_frames()
    assert spread[0] == 0 and spread[-1] == 49 and len(spread) == 8  # evenly spread, the current one included
    many = FrameStepper(list(range(700)), draw_bars, figsize=(2, 2), marks={i: "e" for i in range(40, 680, 20)})
    assert many.key_frames() == [0, 40, 140, 240, 360, 460, 560, 660]  # the current one, marks spread over the run


def test_stepper_rejects_empty_traces_and_wrong_titles():
    with pytest.raises(ValueError):
        FrameStepper([], draw_bars)
    with pytest.raises(ValueError):
        FrameStepper([1, 2], draw_bars, titles=["only one"])


def test_small_multiples_one_panel_per_frame():
    fig = draw_small_multiples([1, 2, 3, 4, 5], draw_bars, ncols=2, titles=lambda i, f: f"step {i}")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 6 and len(visible) == 5
    assert [ax.get_title() for ax in visible] == [f"step {i}" for i in range(5)]
    assert [len(ax.patches) for ax in visible] == [1, 2, 3, 4, 5]


def test_small_multiples_subset_of_frames():
    fig = draw_small_multiples([1, 2, 3, 4], draw_bars, indices=[0, 3], ncols=4)
    assert len(fig.axes) == 2 and [len(ax.patches) for ax in fig.axes] == [1, 4]
    with pytest.raises(ValueError):
        draw_small_multiples([1], draw_bars, indices=[])
