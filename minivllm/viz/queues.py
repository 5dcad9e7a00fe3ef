"""Pictures of the scheduler at work, drawn from a trace of `StepSnapshot`s.

Every function is pure: it takes snapshots (from `minivllm.viz.sim`, or from an engine watched
by `minivllm.viz.snapshot.SnapshotRecorder`) and a matplotlib `Axes`, draws, and returns nothing.

    draw_queues(snapshot, ax)          waiting / running / swapped with request ids
    draw_batch_grid(snapshots, ax)     slots x steps: prompt, generated, finished, idle
    draw_memory_over_time(snaps, ax)   GPU blocks used / free and CPU blocks swapped
    draw_batch_tokens(snapshots, ax)   prefill and decode tokens per step vs the budget

`queue_stepper` / `batch_grid_stepper` wrap the first two in a Play + slider widget
(`minivllm.viz.widgets`), with a small-multiples static twin for GitHub.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.patches import Patch, Rectangle

from minivllm.viz.snapshot import StepSnapshot
from minivllm.viz.style import COLORS

# Grid cells: what one batch slot does in one step.
CELL_KINDS = ("prompt", "generated", "finished", "idle")
_EMPTY = ""  # a request not in the batch this step (request rows only): drawn white
_QUEUES = ("waiting", "running", "swapped")
_BOX_WIDTH = 0.9
_MAX_LABELLED_STEPS = 48  # wider grids get no text in their cells
_MAX_BOXES = 24  # a queue longer than this is drawn as its first boxes and "+N"
_MIN_LANE_WIDTH = 10  # boxes keep one size however short the queues are


# ====================================================================== queues
def draw_queues(snapshot: StepSnapshot, ax, max_boxes: int = _MAX_BOXES) -> None:
    """Three lanes (waiting, running, swapped), one box per request id, in queue order.

    Running boxes are filled by what the request does this step: prompt colour for a
    prefill, generated colour for a decode, white when it holds memory but was not
    scheduled. Preempted and swapped-in requests are named in the title.
    """
    phases = {e.request_id: e.phase for e in snapshot.batch}
    for lane, queue in enumerate(_QUEUES):
        y = len(_QUEUES) - 1 - lane
        request_ids = getattr(snapshot, queue)
        ax.text(-0.2, y, f"{queue} ({len(request_ids)})", ha="right", va="center", fontsize=9,
                color=COLORS[queue], fontweight="bold")
        for x, request_id in enumerate(request_ids[:max_boxes]):
            face = _box_color(queue, phases.get(request_id))
            ax.add_patch(Rectangle((x, y - 0.35), _BOX_WIDTH, 0.7, facecolor=face,
                                   edgecolor=COLORS[queue], linewidth=1.5))
            text_color = "white" if face in (COLORS["waiting"], COLORS["swapped"]) else COLORS["edge"]
            ax.text(x + _BOX_WIDTH / 2, y, request_id, ha="center", va="center", fontsize=8,
                    color=text_color)
        if len(request_ids) > max_boxes:
            ax.text(max_boxes + 0.1, y, f"+{len(request_ids) - max_boxes}", va="center", fontsize=8)
    width = max(_MIN_LANE_WIDTH, min(max_boxes, max(len(getattr(snapshot, q)) for q in _QUEUES))) + 1
    ax.set_xlim(-0.2, width)
    ax.set_ylim(-0.6, len(_QUEUES) - 0.4)
    ax.set_axis_off()
    ax.set_title(_step_title(snapshot), fontsize=9, loc="left")
    ax.legend(handles=[Patch(facecolor=COLORS["prompt"], label="prefill this step"),
                       Patch(facecolor=COLORS["generated"], label="decode this step"),
                       Patch(facecolor="white", edgecolor=COLORS["running"], label="not scheduled")],
              loc="lower right", fontsize=7, frameon=False, ncol=3, bbox_to_anchor=(1.0, -0.12))


def _box_color(queue: str, phase: str | None) -> str:
    if queue == "running":
        return {"prefill": COLORS["prompt"], "decode": COLORS["generated"]}.get(phase, "white")
    return COLORS[queue]


def _step_title(snapshot: StepSnapshot) -> str:
    parts = [f"step {snapshot.step}: {snapshot.num_batched_tokens} tokens, "
             f"{snapshot.num_scheduled_seqs} seqs, {snapshot.num_free_gpu_blocks}/"
             f"{snapshot.num_gpu_blocks} GPU blocks free"]
    events = (("recomputed", snapshot.preempted_by_recompute), ("swapped out", snapshot.preempted_by_swap),
              ("swapped in", snapshot.swapped_in), ("ignored", list(snapshot.ignored)),
              ("finished", snapshot.finished), ("aborted", snapshot.aborted))
    parts += [f"{name}: {', '.join(ids)}" for name, ids in events if ids]
    return "\n".join([parts[0], "; ".join(parts[1:])]) if len(parts) > 1 else parts[0]


# ================================================================== batch grid
@dataclass
class BatchGrid:
    """kinds[row][step] in CELL_KINDS (or "" for no request); labels[row][step] request ids."""

    kinds: list[list[str]]
    labels: list[list[str]]
    row_names: list[str]

    @property
    def num_steps(self) -> int:
        return len(self.kinds[0]) if self.kinds else 0

    def count(self, kind: str) -> int:
        return sum(row.count(kind) for row in self.kinds)

    def utilization(self) -> float:
        """Busy cells (prompt, generated, finished) over all slot cells."""
        busy = sum(self.count(k) for k in ("prompt", "generated", "finished"))
        total = busy + self.count("idle")
        return busy / total if total else 0.0


def batch_grid(snapshots: Sequence[StepSnapshot], num_slots: int | None = None,
               by: str = "slot") -> BatchGrid:
    """The classic batching picture as data.

    by="slot": one row per batch slot (a sequence keeps its slot while it is in the running
    queue, a new one takes the lowest free slot); an empty slot, a padded one, or one whose
    sequence is not scheduled this step (a decode paused for a prefill step) is "idle". `num_slots`
    defaults to the most sequences seen in one step (pass `max_num_seqs` to show the
    capacity the scheduler could have used).
    by="request": one row per request; "" where it is not in the batch.
    """
    if by not in ("slot", "request"):
        raise ValueError(f"by must be 'slot' or 'request', got {by!r}.")
    if by == "request":
        return _grid_by_request(snapshots)
    return _grid_by_slot(snapshots, num_slots)


def _cells(snapshot: StepSnapshot) -> list[tuple[tuple[str, int], str]]:
    """((request_id, seq_id), kind) for every sequence in the step's batch."""
    finished_requests, finished_seqs = set(snapshot.finished), set(snapshot.finished_seq_ids)
    cells = []
    for entry in snapshot.batch:
        for seq_id in entry.seq_ids:
            if entry.phase == "idle":
                kind = "idle"
            elif seq_id in finished_seqs or entry.request_id in finished_requests:
                kind = "finished"
            else:
                kind = "prompt" if entry.is_prefill else "generated"
            cells.append(((entry.request_id, seq_id), kind))
    return cells


def _grid_by_slot(snapshots: Sequence[StepSnapshot], num_slots: int | None) -> BatchGrid:
    per_step = [_cells(s) for s in snapshots]
    widest = max((max(len(c), _num_resident(s)) for s, c in zip(snapshots, per_step)), default=0)
    num_slots = widest if num_slots is None else max(num_slots, widest)
    kinds = [["idle"] * len(snapshots) for _ in range(num_slots)]
    labels = [[""] * len(snapshots) for _ in range(num_slots)]
    slot_of: dict[tuple[str, int], int] = {}
    for step, (snapshot, cells) in enumerate(zip(snapshots, per_step)):
        # A sequence keeps its slot while it holds GPU memory, scheduled this step or not.
        present = {key for key, _ in cells} | {
            (rid, seq_id) for rid in snapshot.running for seq_id in snapshot.block_tables.get(rid, {})}
        slot_of = {key: slot for key, slot in slot_of.items() if key in present}
        for key, kind in cells:
            if key not in slot_of:
                slot_of[key] = min(set(range(num_slots)) - set(slot_of.values()))
            kinds[slot_of[key]][step] = kind
            labels[slot_of[key]][step] = key[0]
    return BatchGrid(kinds, labels, [f"slot {i}" for i in range(num_slots)])


def _num_resident(snapshot: StepSnapshot) -> int:
    return sum(len(snapshot.block_tables.get(rid, {})) for rid in snapshot.running)


def _grid_by_request(snapshots: Sequence[StepSnapshot]) -> BatchGrid:
    rows: dict[str, int] = {}
    for snapshot in snapshots:
        for entry in snapshot.batch:
            rows.setdefault(entry.request_id, len(rows))
    kinds = [[_EMPTY] * len(snapshots) for _ in rows]
    labels = [[""] * len(snapshots) for _ in rows]
    rank = {"finished": 3, "prompt": 2, "generated": 1, "idle": 0}
    for step, snapshot in enumerate(snapshots):
        for (request_id, _), kind in _cells(snapshot):
            row = rows[request_id]
            if kinds[row][step] == _EMPTY or rank[kind] > rank[kinds[row][step]]:
                kinds[row][step] = kind
            labels[row][step] = request_id
    return BatchGrid(kinds, labels, [f"req {rid}" for rid in rows])


def _default_title(grid: BatchGrid) -> str:
    # Utilization is a property of slots: a row per request is busy by construction whenever it
    # is in the batch, so its "utilization" would read 100 % whatever the scheduler did.
    if grid.row_names and all(name.startswith("req ") for name in grid.row_names):
        return "one row per request (prompt / generated / finished)"
    return f"slot utilization {grid.utilization():.0%}"


def draw_batch_grid(grid: BatchGrid | Sequence[StepSnapshot], ax, num_slots: int | None = None,
                    by: str = "slot", upto_step: int | None = None, title: str | None = None) -> None:
    """Rows (slots or requests) x steps, coloured prompt / generated / finished / idle.

    `grid` is a `BatchGrid` or a list of snapshots. `upto_step` draws only the steps up to
    it (for a stepper) but keeps the axes of the whole run.
    """
    if not isinstance(grid, BatchGrid):
        grid = batch_grid(grid, num_slots=num_slots, by=by)
    last = grid.num_steps if upto_step is None else min(grid.num_steps, upto_step + 1)
    label_cells = grid.num_steps <= _MAX_LABELLED_STEPS
    for row, (kinds, labels) in enumerate(zip(grid.kinds, grid.labels)):
        y = len(grid.kinds) - 1 - row
        for step in range(last):
            kind = kinds[step]
            color = COLORS[kind] if kind else "white"
            ax.add_patch(Rectangle((step, y), 1, 1, facecolor=color, edgecolor="white",
                                   linewidth=1.0 if label_cells else 0.2))
            if label_cells and labels[step] and kind != "idle":
                ax.text(step + 0.5, y + 0.5, labels[step], ha="center", va="center", fontsize=6,
                        color="white" if kind == "finished" else COLORS["edge"])
    ax.set_xlim(0, max(grid.num_steps, 1))
    ax.set_ylim(0, max(len(grid.kinds), 1))
    ax.set_yticks([len(grid.kinds) - 1 - r + 0.5 for r in range(len(grid.kinds))], grid.row_names,
                  fontsize=7)
    ax.set_xlabel("step (iteration)")
    ax.set_title(title or _default_title(grid), fontsize=9, loc="left")
    ax.legend(handles=[Patch(facecolor=COLORS[k], label=k) for k in CELL_KINDS],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False, fontsize=7)


# ====================================================================== memory
def draw_memory_over_time(snapshots: Sequence[StepSnapshot], ax, upto_step: int | None = None) -> None:
    """GPU blocks used (filled) under the pool size, CPU blocks holding swapped-out KV
    cache, and a tick on top at every step with a preemption."""
    shown = snapshots if upto_step is None else snapshots[: upto_step + 1]
    steps = [s.step for s in shown]
    used = [s.num_used_gpu_blocks for s in shown]
    swapped = [s.num_swapped_blocks for s in shown]
    num_gpu_blocks = snapshots[0].num_gpu_blocks if snapshots else 0
    ax.fill_between(steps, 0, used, step="post", color=COLORS["used"], alpha=0.85, label="GPU blocks used")
    ax.fill_between(steps, used, num_gpu_blocks, step="post", facecolor=COLORS["free"],
                    edgecolor=COLORS["idle"], hatch="///", linewidth=0, label="GPU blocks free")
    ax.step(steps, swapped, where="post", color=COLORS["swapped"], linewidth=2,
            label="CPU blocks (swapped out)")
    ax.axhline(num_gpu_blocks, color=COLORS["edge"], linestyle="--", linewidth=1)
    preempted = [s.step for s in shown if s.preempted]
    if preempted:
        ax.plot(preempted, [num_gpu_blocks * 1.04] * len(preempted), "v", color=COLORS["copied"],
                markersize=5, label="preemption")
    ax.set_xlim(0, max(len(snapshots) - 1, 1))
    ax.set_ylim(0, max(num_gpu_blocks, max(swapped, default=0)) * 1.1 + 1)
    ax.set_xlabel("step")
    ax.set_ylabel("blocks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False, fontsize=7)


def draw_batch_tokens(snapshots: Sequence[StepSnapshot], ax, max_num_batched_tokens: int | None = None) -> None:
    """Stacked bars per step: prefill tokens and decode tokens, with the token budget."""
    steps = [s.step for s in snapshots]
    prefill = [s.num_prefill_tokens for s in snapshots]
    decode = [s.num_decode_tokens for s in snapshots]
    ax.bar(steps, prefill, width=1.0, color=COLORS["prompt"], label="prefill tokens")
    ax.bar(steps, decode, width=1.0, bottom=prefill, color=COLORS["generated"], label="decode tokens")
    if max_num_batched_tokens is not None:
        ax.axhline(max_num_batched_tokens, color=COLORS["edge"], linestyle="--", linewidth=1,
                   label="max_num_batched_tokens")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in the batch")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False, fontsize=7)


# ===================================================== widgets and static twins
def queue_events(snapshots: Sequence[StepSnapshot]) -> dict[int, str]:
    """Frame index -> what the queues did there, for the steps that preempt or swap in
    ("step 47: swapped out r3"); ordinary decode steps are left out."""
    events = {}
    for index, snapshot in enumerate(snapshots):
        happened = [f"{name} {', '.join(ids)}" for name, ids in (
            ("recomputed", snapshot.preempted_by_recompute), ("swapped out", snapshot.preempted_by_swap),
            ("swapped in", snapshot.swapped_in)) if ids]
        if happened:
            events[index] = f"step {snapshot.step}: " + "; ".join(happened)
    return events


def queue_stepper(snapshots: Sequence[StepSnapshot], figsize: tuple[float, float] = (9.0, 3.0)):
    """Play + slider over the queue view of each step (`minivllm.viz.widgets.FrameStepper`), with
    a "jump to" menu of the steps that preempt or swap in (`queue_events`)."""
    from minivllm.viz.widgets import FrameStepper  # ipywidgets only when a widget is asked for

    return FrameStepper(snapshots, draw_queues, figsize=figsize, marks=queue_events(snapshots))


def draw_queues_small_multiples(snapshots: Sequence[StepSnapshot], indices: Sequence[int] | None = None,
                                ncols: int = 2):
    """The static twin of `queue_stepper`: the chosen steps side by side; returns the figure."""
    from minivllm.viz.widgets import draw_small_multiples

    return draw_small_multiples(snapshots, draw_queues, indices=indices, ncols=ncols,
                                panel_size=(6.5, 2.8))


def batch_grid_stepper(snapshots: Sequence[StepSnapshot], num_slots: int | None = None,
                       by: str = "slot", figsize: tuple[float, float] = (9.0, 3.0)):
    """Play + slider that fills the batch grid one step at a time."""
    from minivllm.viz.widgets import FrameStepper

    grid = batch_grid(snapshots, num_slots=num_slots, by=by)
    return FrameStepper(
        list(range(grid.num_steps)),
        lambda step, ax: draw_batch_grid(grid, ax, upto_step=step, title=f"after step {step}"),
        figsize=figsize)


def draw_batch_grid_small_multiples(snapshots: Sequence[StepSnapshot], indices: Sequence[int],
                                    num_slots: int | None = None, by: str = "slot", ncols: int = 2):
    """The static twin of `batch_grid_stepper`: the grid as it stood at the chosen steps."""
    from minivllm.viz.widgets import draw_small_multiples

    grid = batch_grid(snapshots, num_slots=num_slots, by=by)
    return draw_small_multiples(
        list(range(grid.num_steps)),
        lambda step, ax: draw_batch_grid(grid, ax, upto_step=step, title=f"after step {step}"),
        indices=indices, ncols=ncols, panel_size=(6.5, 2.8))


# ================================================================= trade-offs
def draw_latency_tradeoff(points: dict[str, tuple[float, float]], ax, xlabel: str = "max inter-token latency (ms)",
                          ylabel: str = "time to first token (ms)") -> None:
    """One labelled point per configuration, joined in the given order (a trade-off curve).

    `points`: label -> (x, y), e.g. {"budget 64": (max_itl, ttft), ...}.
    """
    labels = list(points)
    xs = [points[label][0] for label in labels]
    ys = [points[label][1] for label in labels]
    ax.plot(xs, ys, "-o", color=COLORS["running"], markersize=5)
    for i, (label, x, y) in enumerate(zip(labels, xs, ys)):
        # Alternate above / below so neighbouring points keep readable labels.
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 5 if i % 2 == 0 else -12),
                    fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def draw_preemption_costs(block_sizes: Sequence[int], costs: dict[str, Sequence[float]], ax,
                          ylabel: str = "ms per preempted token") -> None:
    """Cost of a preemption against the block size, one line per mode ("recompute", "swap").

    Recompute is drawn in the prompt colour (it is a prefill again), swap in the swapped colour.
    """
    colors = {"recompute": COLORS["prompt"], "swap": COLORS["swapped"]}
    for mode, values in costs.items():
        ax.plot(block_sizes, values, "-o", color=colors.get(mode, COLORS["edge"]), label=mode, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(block_sizes), [str(b) for b in block_sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
