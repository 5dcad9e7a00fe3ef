"""Queue, batch-grid and memory pictures: the data behind them and what gets drawn.

Expected values come from the workload itself (each request's output length) and the
definition of the pictures, not from re-running our drawing code.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from minivllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from minivllm.viz.sim import SimRequest, Simulator, simulate_static_batching  # noqa: E402
from minivllm.viz import COLORS  # noqa: E402
from minivllm.viz.queues import (  # noqa: E402
    batch_grid,
    draw_batch_grid,
    draw_batch_tokens,
    draw_memory_over_time,
    draw_queues,
)

OUTPUT_LENS = [2, 7, 3, 5, 1, 4]


def workload():
    return [SimRequest(str(i), [1, 2, 3, 4, 5], [n]) for i, n in enumerate(OUTPUT_LENS)]


def run(num_gpu_blocks=64, num_cpu_blocks=0, **kwargs):
    kwargs.setdefault("max_num_seqs", 3)
    return Simulator(SchedulerConfig(max_model_len=64, **kwargs),
                     CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks,
                                 num_cpu_blocks=num_cpu_blocks)).run(workload())


def rectangles(ax, color):
    return [p for p in ax.patches if isinstance(p, Rectangle) and to_hex(p.get_facecolor()) == to_hex(color)]


def test_request_rows_show_one_prompt_then_decodes_then_the_end():
    grid = batch_grid(run().snapshots, by="request")
    assert len(grid.kinds) == len(OUTPUT_LENS)
    for request_id, length in enumerate(OUTPUT_LENS):
        row = grid.kinds[grid.row_names.index(f"req {request_id}")]
        busy = [k for k in row if k]
        # The prefill makes the first token; each decode one more; the last is the end.
        assert len(busy) == length and busy[-1] == "finished"
        assert busy.count("prompt") == (1 if length > 1 else 0)
        assert busy.count("generated") == max(length - 2, 0)


def test_static_grid_pads_every_batch_to_its_longest_request():
    result = simulate_static_batching(workload(), batch_size=3)
    grid = batch_grid(result.snapshots, num_slots=3)
    # batches [2, 7, 3] and [5, 1, 4]: 7 + 5 steps, 3 slots each
    assert grid.num_steps == 12
    assert grid.count("idle") == (7 - 2) + (7 - 3) + (5 - 1) + (5 - 4)
    assert grid.utilization() == pytest.approx(sum(OUTPUT_LENS) / (3 * 12))
    assert grid.utilization() == pytest.approx(result.stats.slot_utilization)


def test_continuous_grid_keeps_each_sequence_in_one_slot_and_refills_slots():
    result = run()
    grid = batch_grid(result.snapshots, num_slots=3)
    rows_of = {}
    for row, labels in enumerate(grid.labels):
        for label in labels:
            if label:
                rows_of.setdefault(label, set()).add(row)
    assert all(len(rows) == 1 for rows in rows_of.values())  # no preemption: a slot each
    assert len(rows_of) == len(OUTPUT_LENS) > len(grid.kinds)  # slots were reused
    assert grid.utilization() == pytest.approx(result.stats.slot_utilization)
    assert grid.utilization() > batch_grid(simulate_static_batching(workload(), 3).snapshots,
                                           num_slots=3).utilization()


def test_batch_grid_rejects_an_unknown_layout():
    with pytest.raises(ValueError, match="by must be"):
        batch_grid([], by="time")


def test_draw_batch_grid_colours_every_cell():
    result = simulate_static_batching(workload(), batch_size=3)
    grid = batch_grid(result.snapshots, num_slots=3)
    fig, ax = plt.subplots()
    draw_batch_grid(grid, ax)
    plt.close(fig)
    for kind in ("prompt", "generated", "finished", "idle"):
        assert len(rectangles(ax, COLORS[kind])) == grid.count(kind)
    fig, ax = plt.subplots()
    draw_batch_grid(result.snapshots, ax, num_slots=3, upto_step=2)
    plt.close(fig)
    assert len([p for p in ax.patches if isinstance(p, Rectangle)]) == 3 * 3  # steps 0..2 only


def test_draw_queues_lists_every_request_in_its_lane():
    result = run(num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="swap")
    snapshot = next(s for s in result.snapshots if s.swapped)
    fig, ax = plt.subplots()
    draw_queues(snapshot, ax)
    plt.close(fig)
    texts = [t.get_text() for t in ax.texts]
    for queue in ("waiting", "running", "swapped"):
        ids = getattr(snapshot, queue)
        assert f"{queue} ({len(ids)})" in texts
        assert all(rid in texts for rid in ids)
    decodes = [e for e in snapshot.batch if e.phase == "decode"]
    assert len(rectangles(ax, COLORS["generated"])) == len(decodes)
    assert len(rectangles(ax, COLORS["swapped"])) == len(snapshot.swapped)


def test_memory_over_time_plots_used_and_swapped_blocks():
    result = run(num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="swap")
    snapshots = result.snapshots
    fig, ax = plt.subplots()
    draw_memory_over_time(snapshots, ax)
    plt.close(fig)
    (swapped_line,) = [l for l in ax.lines if l.get_label() == "CPU blocks (swapped out)"]
    assert list(swapped_line.get_ydata()) == [s.num_swapped_blocks for s in snapshots]
    assert max(swapped_line.get_ydata()) > 0  # this workload does swap
    (marks,) = [l for l in ax.lines if l.get_label() == "preemption"]
    assert list(marks.get_xdata()) == [s.step for s in snapshots if s.preempted]


def test_batch_tokens_bars_add_up_to_the_batch():
    result = run(enable_chunked_prefill=True, max_num_batched_tokens=8)
    fig, ax = plt.subplots()
    draw_batch_tokens(result.snapshots, ax, max_num_batched_tokens=8)
    plt.close(fig)
    heights = [p.get_height() for p in ax.patches]
    n = len(result.snapshots)
    totals = [heights[i] + heights[n + i] for i in range(n)]
    assert totals == [s.num_batched_tokens for s in result.snapshots]
    assert max(totals) <= 8


def test_queue_stepper_and_its_static_twin():
    from minivllm.viz.queues import (
        batch_grid_stepper,
        draw_batch_grid_small_multiples,
        draw_queues_small_multiples,
        queue_stepper,
    )

    snapshots = run().snapshots
    stepper = queue_stepper(snapshots)
    stepper.slider.value = 3
    assert stepper.frame is snapshots[3] and stepper.image.value  # a PNG was rendered
    fig = draw_queues_small_multiples(snapshots, indices=[0, 1, 2])
    plt.close(fig)
    assert sum(ax.get_visible() for ax in fig.axes) == 3
    grid_stepper = batch_grid_stepper(snapshots, num_slots=3)
    grid_stepper.play.value = len(snapshots) - 1
    assert grid_stepper.index == len(snapshots) - 1
    fig = draw_batch_grid_small_multiples(snapshots, indices=[1, 5], num_slots=3)
    plt.close(fig)
    assert [ax.get_title(loc="left") for ax in fig.axes if ax.get_visible()] == ["after step 1",
                                                                                 "after step 5"]


def test_queue_stepper_jumps_to_the_steps_that_preempt():
    from minivllm.viz.queues import queue_events, queue_stepper

    snapshots = run(num_gpu_blocks=6, max_num_seqs=4).snapshots
    preempting = [i for i, s in enumerate(snapshots) if s.preempted_by_recompute]
    assert preempting, "the workload must preempt for this test to mean anything"
    events = queue_events(snapshots)
    assert sorted(events) == [i for i, s in enumerate(snapshots) if s.preempted_by_recompute or s.swapped_in]
    first = preempting[0]
    assert events[first] == f"step {snapshots[first].step}: recomputed {', '.join(snapshots[first].preempted_by_recompute)}"
    stepper = queue_stepper(snapshots)
    stepper.jump.value = first
    assert stepper.frame is snapshots[first]


def test_latency_tradeoff_plots_each_point_in_order():
    from minivllm.viz.queues import draw_latency_tradeoff

    fig, ax = plt.subplots()
    draw_latency_tradeoff({"a": (1.0, 9.0), "b": (2.0, 5.0), "c": (4.0, 3.0)}, ax)
    plt.close(fig)
    (line,) = ax.lines
    assert list(line.get_xdata()) == [1.0, 2.0, 4.0] and list(line.get_ydata()) == [9.0, 5.0, 3.0]
    assert [t.get_text() for t in ax.texts] == ["a", "b", "c"]


def test_preemption_costs_draw_one_line_per_mode():
    from minivllm.viz.queues import draw_preemption_costs

    fig, ax = plt.subplots()
    draw_preemption_costs([1, 16, 256], {"recompute": [1.0, 1.0, 1.0], "swap": [3.0, 1.0, 0.9]}, ax)
    plt.close(fig)
    assert [line.get_label() for line in ax.lines] == ["recompute", "swap"]
    assert to_hex(ax.lines[0].get_color()) == to_hex(COLORS["prompt"])
    assert list(ax.lines[1].get_ydata()) == [3.0, 1.0, 0.9]
