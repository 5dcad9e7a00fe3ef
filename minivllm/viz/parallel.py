"""Watching a model split over ranks: collectives counted, pipeline stages timed and drawn.

Course tooling (notebook 16), outside the runtime:

    CollectiveCounter   counts every torch.distributed call this process makes (and its
                        bytes) while active, by wrapping the torch.distributed functions
    PipelineTimer       times a pipeline-parallel executor's calls from the driver's side: the
                        driver runs stage 0 in-process, so its model runner's forward gives
                        stage 0's interval, and each call's collection the last stage's end
    overlapped_schedule the schedule the same stage times would give with several batches in
                        flight (vLLM v0's virtual engines)
    draw_pipeline_schedule  the Gantt chart: one row per stage, one box per (stage, batch)
    draw_tp_speedups    measured TP speed-ups as bars beside the ideal (tp×)

    >>> overlapped_schedule([[1.0, 1.0], [1.0, 1.0]])  # two batches, two stages
    [(0, 0, 0.0, 1.0), (1, 0, 1.0, 2.0), (0, 1, 1.0, 2.0), (1, 1, 2.0, 3.0)]
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist

from minivllm.viz.style import COLORS, request_color

# The torch.distributed functions the process groups call.
_COUNTED = ("all_reduce", "all_gather", "gather", "send", "recv")

# (stage, batch, start, end): one stage working on one batch.
Interval = tuple[int, int, float, float]


@dataclass
class CollectiveCounter:
    """`with CollectiveCounter() as counter:` ... `counter.calls["all_reduce"]`, `counter.bytes`.

    Counts only this process's calls (every TP rank makes the same ones)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    shapes: list = field(default_factory=list)

    def __enter__(self) -> "CollectiveCounter":
        self._originals = {name: getattr(dist, name) for name in _COUNTED}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            self.calls[name] += 1
            self.bytes[name] += tensor.numel() * tensor.element_size()
            self.shapes.append((name, tuple(tensor.shape)))
            return original(tensor, *args, **kwargs)

        return counted


class PipelineTimer:
    """Times a pipeline-parallel (PP=2) `mp` executor's calls from the driver (stage 0).

    `intervals`: (stage, call, start, end), seconds from the first call. The driver runs
    stage 0 in this process, so its model runner's forward gives stage 0's interval exactly.
    Stage 1 works on call k from when it has both stage 0's tensors and finished call k - 1,
    until call k's results are collected: [max(stage 0's end, previous collection),
    collection] (this includes the transfers). Works for the plain engine
    (`engine.model_executor`) and for virtual engines (`engine.shared.executor`).
    """

    def __init__(self, executor) -> None:
        if executor.engine_config.parallel_config.pipeline_parallel_size != 2 or not hasattr(executor, "driver_worker"):
            raise ValueError("PipelineTimer times an mp executor with pipeline_parallel_size=2.")
        self._origin: float | None = None
        self._stage0: list[tuple[float, float]] = []
        self._collected: list[float] = []
        runner = executor.driver_worker.model_runner
        self._forward, self._finish = runner.execute_model, executor._finish_call
        runner.execute_model, executor._finish_call = self._timed_forward, self._timed_finish

    def _now(self) -> float:
        now = time.perf_counter()
        if self._origin is None:
            self._origin = now
        return now - self._origin

    def _timed_forward(self, *args, **kwargs):
        start = self._now()
        output = self._forward(*args, **kwargs)
        self._stage0.append((start, self._now()))
        return output

    def _timed_finish(self, *args):
        results = self._finish(*args)
        self._collected.append(self._now())
        return results

    @property
    def intervals(self) -> list[Interval]:
        intervals, previous = [], 0.0
        for call, ((start, end), collected) in enumerate(zip(self._stage0, self._collected)):
            intervals += [(0, call, start, end), (1, call, max(end, previous), collected)]
            previous = collected
        return intervals


def stage_durations(intervals: list[Interval]) -> list[list[float]]:
    """[batch][stage] -> seconds, from measured intervals."""
    batches = sorted({batch for _, batch, _, _ in intervals})
    stages = sorted({stage for stage, _, _, _ in intervals})
    table = {(stage, batch): end - start for stage, batch, start, end in intervals}
    return [[table[(stage, batch)] for stage in stages] for batch in batches]


def overlapped_schedule(durations: list[list[float]]) -> list[Interval]:
    """Batch b enters stage s once stage s - 1 has finished it and stage s has finished b - 1:
    the schedule with every batch independent (virtual engines: each batch its own scheduler)."""
    ends: dict[tuple[int, int], float] = {}
    intervals = []
    for batch, per_stage in enumerate(durations):
        for stage, duration in enumerate(per_stage):
            start = max(ends.get((stage - 1, batch), 0.0), ends.get((stage, batch - 1), 0.0))
            ends[(stage, batch)] = start + duration
            intervals.append((stage, batch, start, start + duration))
    return intervals


def utilization(intervals: list[Interval]) -> list[float]:
    """Each stage's busy fraction of the whole schedule's span."""
    span = max(end for *_, end in intervals) - min(start for _, _, start, _ in intervals)
    stages = sorted({stage for stage, *_ in intervals})
    return [sum(end - start for s, _, start, end in intervals if s == stage) / span for stage in stages]


def draw_pipeline_schedule(ax, intervals: list[Interval], title: str = "") -> None:
    """Gantt chart: one row per stage (stage 0 on top), a box per (stage, batch) coloured by
    batch; the grey background is idle time, the pipeline bubble."""
    stages = sorted({stage for stage, *_ in intervals})
    span = max(end for *_, end in intervals)
    for stage in stages:
        ax.barh(stage, span, left=0, height=0.8, color=COLORS["idle"])
    for stage, batch, start, end in intervals:
        ax.barh(stage, end - start, left=start, height=0.8, color=request_color(batch), edgecolor=COLORS["edge"],
                linewidth=0.5)
        ax.text((start + end) / 2, stage, str(batch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title)


def draw_tp_speedups(ax, speedups: dict[str, float], ideal: float, title: str = "") -> None:
    """`speedups`: measurement -> TP=n over TP=1 (higher is better), one bar each, beside a
    dashed line at the `ideal` (n: every rank's share of the work, and nothing added)."""
    names = list(speedups)
    ax.barh(range(len(names)), [speedups[n] for n in names], height=0.6, color=COLORS["gpu"],
            edgecolor=COLORS["edge"], linewidth=0.5, label="measured")
    for y, name in enumerate(names):
        ax.text(speedups[name], y, f" {speedups[name]:.2f}×", va="center", fontsize=8)
    ax.axvline(ideal, color=COLORS["finished"], linestyle="--", linewidth=1.5, label=f"ideal ({ideal:g}×)")
    ax.axvline(1.0, color=COLORS["copied"], linewidth=1, label="no gain (1×)")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, max(ideal, *speedups.values()) * 1.15)
    ax.set_xlabel("speed-up over TP=1")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
