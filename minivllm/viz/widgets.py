"""A generic stepper widget over a recorded trace, and its static twin.

Any pure drawing function `draw_fn(frame, ax)` becomes

    FrameStepper(frames, draw_fn)          Play + slider; the picture of frame i as PNG
    draw_small_multiples(frames, draw_fn)  the same frames side by side in one figure

The stepper renders each frame to PNG bytes (cached) in an `ipywidgets.Image`, so it needs
no live matplotlib backend and its state is plain Python you can assert on:

    >>> stepper = FrameStepper([1, 2, 3], lambda n, ax: ax.bar(range(n), range(n)))
    >>> stepper.slider.value = 2
    >>> stepper.index, stepper.frame
    (2, 3)

The small-multiples figure is what GitHub and HTML exports show, since widgets need a kernel.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

DrawFn = Callable[[Any, Any], Any]  # draw_fn(frame, ax) draws one frame on one Axes
Titles = Sequence[str] | Callable[[int, Any], str] | None

_DEFAULT_INTERVAL_MS = 800  # Play speed: slow enough to read a block table
_DEFAULT_DPI = 100
# Key frames saved with a stepper's output, for pages without a kernel (the course site steps
# through them): a few, since each is a PNG stored in the notebook.
FRAMES_MIME = "application/vnd.minivllm.frames+json"
_KEY_FRAMES = 8


def _title(titles: Titles, index: int, frame: Any) -> str | None:
    if titles is None:
        return None
    return titles(index, frame) if callable(titles) else titles[index]


def render_frame(frame: Any, draw_fn: DrawFn, figsize: tuple[float, float], title: str | None = None,
                 dpi: int = _DEFAULT_DPI) -> bytes:
    """PNG bytes of `draw_fn(frame, ax)` on a fresh figure (closed afterwards).

    Every frame has the same pixel size (`figsize` × `dpi`, no tight bounding box), so a stepper
    never changes width or stretches its image from one frame to the next."""
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    try:
        draw_fn(frame, ax)
        if title:
            ax.set_title(title, fontsize=10)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi)
        return buffer.getvalue()
    finally:
        plt.close(fig)


class FrameStepper:
    """Play + IntSlider over `frames`; shows `draw_fn(frames[i], ax)` for the chosen i.

    Args:
        frames: the recorded trace (snapshots, states: anything `draw_fn` understands).
        draw_fn: `draw_fn(frame, ax)`, a pure drawing function.
        titles: one title per frame, or `titles(index, frame) -> str`, or None.
        figsize: size of each rendered frame in inches.
        interval_ms: time between frames while playing.
        description: the slider's label.
        marks: frame index -> what happens there; a "jump to" menu reaches each at once (a trace
            of hundreds of steps has its few interesting ones listed, not hidden in the slider).

    Attributes: `play`, `slider`, `image`, `jump` (the widgets; `jump` None without marks),
    `widget` (their layout), `index` / `frame` (the current position).
    """

    def __init__(self, frames: Sequence[Any], draw_fn: DrawFn, *, titles: Titles = None,
                 figsize: tuple[float, float] = (8.0, 3.0), interval_ms: int = _DEFAULT_INTERVAL_MS,
                 description: str = "step", marks: Mapping[int, str] | None = None) -> None:
        if len(frames) == 0:
            raise ValueError("a stepper needs at least one frame.")
        if titles is not None and not callable(titles) and len(titles) != len(frames):
            raise ValueError(f"got {len(titles)} titles for {len(frames)} frames.")
        outside = sorted(i for i in marks or {} if not 0 <= i < len(frames))
        if outside:
            raise ValueError(f"marks at frames {outside} outside the {len(frames)} frames.")
        import ipywidgets as widgets  # deferred: `import minivllm.viz` must work without it

        self.frames = list(frames)
        self.draw_fn, self.titles, self.figsize = draw_fn, titles, figsize
        self.marks = dict(marks or {})
        self._png_cache: dict[int, bytes] = {}
        last = len(self.frames) - 1
        self.play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms)
        self.slider = widgets.IntSlider(value=0, min=0, max=last, description=description)
        widgets.jslink((self.play, "value"), (self.slider, "value"))  # in the browser
        self.play.observe(self._on_play, names="value")  # and in Python, without a browser
        # A fixed frame: the image's box is the PNG's own pixel size, never stretched.
        width, height = (round(inches * _DEFAULT_DPI) for inches in figsize)
        self.image = widgets.Image(format="png", value=self._render(0),
                                   layout=widgets.Layout(width=f"{width}px", height=f"{height}px"))
        self.slider.observe(self._on_slider, names="value")
        controls = [self.play, self.slider]
        self.jump = None
        if marks:
            self.jump = widgets.Dropdown(options=[("jump to…", None)] + [(f"{label} ({i})", i)
                                                                        for i, label in sorted(marks.items())])
            self.jump.observe(self._on_jump, names="value")
            controls.append(self.jump)
        self.widget = widgets.VBox([widgets.HBox(controls), self.image])

    @property
    def index(self) -> int:
        return self.slider.value

    @property
    def frame(self) -> Any:
        return self.frames[self.index]

    def _render(self, index: int) -> bytes:
        if index not in self._png_cache:
            title = _title(self.titles, index, self.frames[index])
            self._png_cache[index] = render_frame(self.frames[index], self.draw_fn, self.figsize, title)
        return self._png_cache[index]

    def _on_slider(self, change: dict) -> None:
        self.image.value = self._render(change["new"])
        self.play.value = change["new"]

    def _on_play(self, change: dict) -> None:
        self.slider.value = change["new"]

    def _on_jump(self, change: dict) -> None:
        if change["new"] is not None:
            self.slider.value = change["new"]

    def key_frames(self) -> list[int]:
        """The frames a page without a kernel steps through: the current one and the marks
        (spread evenly over them when there are more than fit), or without marks frames spread
        evenly from the first to the last."""
        keep = _KEY_FRAMES - 1
        if self.marks:
            marks = sorted(self.marks)
            others = marks if len(marks) <= keep else [marks[round(k * (len(marks) - 1) / (keep - 1))]
                                                       for k in range(keep)]
        else:
            last, count = len(self.frames) - 1, min(_KEY_FRAMES, len(self.frames))
            others = [round(k * last / max(count - 1, 1)) for k in range(count)]
        chosen = [self.index] + [i for i in others if i != self.index][:_KEY_FRAMES - 1]
        return sorted(chosen)

    def _frame_label(self, index: int) -> str:
        title = _title(self.titles, index, self.frames[index])
        return self.marks.get(index) or (title.replace("\n", " ") if title else f"frame {index}")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        """The widget, plus the current frame as a PNG: a viewer without the widget's state
        (GitHub, a static site, a notebook reopened without its kernel) shows the picture
        instead of "VBox(children=...)"; and the key frames (`FRAMES_MIME`), which the course
        site steps through."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["image/png"] = base64.b64encode(self._render(self.index)).decode("ascii")
        bundle["text/plain"] = f"<stepper over {len(self.frames)} frames, showing frame {self.index}>"
        bundle[FRAMES_MIME] = {
            "count": len(self.frames), "shown": self.index,
            "frames": [{"index": i, "label": self._frame_label(i),
                        "png": base64.b64encode(self._render(i)).decode("ascii")} for i in self.key_frames()]}
        return bundle


def draw_small_multiples(frames: Sequence[Any], draw_fn: DrawFn, *, titles: Titles = None,
                         ncols: int = 3, panel_size: tuple[float, float] = (4.0, 2.6),
                         indices: Sequence[int] | None = None, suptitle: str | None = None) -> Figure:
    """The static twin of a `FrameStepper`: one panel per frame, row by row.

    Args:
        frames, draw_fn, titles: as for `FrameStepper`.
        ncols: panels per row.
        panel_size: inches per panel.
        indices: which frames to show (default: all).
        suptitle: a title over the whole figure.

    Returns the figure (close it and `display(fig)` in a notebook). Unused panels are hidden.
    """
    chosen = list(range(len(frames))) if indices is None else list(indices)
    if not chosen:
        raise ValueError("small multiples need at least one frame.")
    if ncols < 1:
        raise ValueError(f"ncols must be at least 1, got {ncols}.")
    ncols = min(ncols, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows),
                             squeeze=False)
    flat = axes.ravel()
    for ax, index in zip(flat, chosen):
        draw_fn(frames[index], ax)
        title = _title(titles, index, frames[index])
        if title:
            ax.set_title(title, fontsize=9)
    for ax in flat[len(chosen):]:
        ax.set_visible(False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig
