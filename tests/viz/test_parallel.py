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
