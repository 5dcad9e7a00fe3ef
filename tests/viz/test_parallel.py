"""The pipeline-schedule helpers of minivllm.viz.parallel, on hand-made stage times."""

import pytest

from minivllm.viz.parallel import overlapped_schedule, stage_durations, utilization


def test_overlapped_schedule_keeps_stage_and_batch_order():
    durations = [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]  # stage 1 is the bottleneck
    schedule = overlapped_schedule(durations)
    starts = {(stage, batch): start for stage, batch, start, _ in schedule}
    assert starts[(1, 0)] == 1.0  # after stage 0 finished batch 0
    assert starts[(0, 1)] == 1.0  # stage 0 goes straight on with batch 1
    assert starts[(1, 2)] == 5.0  # stage 1 runs back to back: 1 + 2 + 2
    assert max(end for *_, end in schedule) == 7.0
    assert utilization(schedule) == pytest.approx([3 / 7, 6 / 7])


def test_one_batch_at_a_time_leaves_the_bubble():
    measured = [(0, 0, 0.0, 1.0), (1, 0, 1.0, 2.0), (0, 1, 2.0, 3.0), (1, 1, 3.0, 4.0)]
    assert stage_durations(measured) == [[1.0, 1.0], [1.0, 1.0]]
    assert utilization(measured) == [0.5, 0.5]  # each of 2 stages idle half the time
    assert utilization(overlapped_schedule(stage_durations(measured))) == pytest.approx([2 / 3, 2 / 3])


def test_draw_tp_speedups_draws_one_bar_per_measurement_and_the_ideal():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.viz.parallel import draw_tp_speedups

    fig, ax = plt.subplots()
    draw_tp_speedups(ax, {"throughput": 1.38, "batch-1 decode": 1.32}, ideal=2.0)
    assert [p.get_width() for p in ax.patches] == [1.38, 1.32]
    assert [line.get_xdata()[0] for line in ax.lines] == [2.0, 1.0]  # the ideal, then no gain
    assert [t.get_text() for t in ax.get_yticklabels()] == ["throughput", "batch-1 decode"]
    plt.close(fig)
