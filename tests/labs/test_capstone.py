"""The capstone's grader (`minivllm/labs/capstone.py`) gives the reference solution full marks,
fails plain FCFS on the shortest-first ordering, and a shortest-first policy without the
starvation bound on that bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm.core.policy import FCFS
from minivllm.labs import capstone

REFERENCE = Path(__file__).with_name("capstone_reference.py")


def _by_test(rows):
    return {row.test.split(" (")[0]: row for row in rows}


def test_reference_gets_full_marks_and_beats_fcfs():
    rows, results = capstone.grade(f"{REFERENCE}:ShortestJobFirst")
    failed = [(row.test, row.detail) for row in rows if row.earned != row.points]
    assert not failed, failed
    assert sum(row.points for row in rows) == 100
    assert results["yours"].mean < results["fcfs"].mean
    table = capstone.format_table("reference", rows, results)
    assert "100/100" in table and "fcfs" in table


def test_fcfs_fails_the_ordering():
    rows = _by_test(capstone.grade(FCFS, with_engine=False)[0])
    assert rows["ordering: shortest prompt first"].earned == 0
    assert "expected" in rows["ordering: shortest prompt first"].detail
    assert rows["engine invariants"].earned == rows["engine invariants"].points  # FCFS loses nothing


def test_shortest_first_without_aging_starves_the_long_prompt():
    rows = _by_test(capstone.grade(f"{REFERENCE}:ShortestPromptFirst", with_engine=False)[0])
    assert rows["ordering: shortest prompt first"].earned == rows["ordering: shortest prompt first"].points
    assert rows["starvation bound"].earned == 0
    assert "waited" in rows["starvation bound"].detail


def test_command_line_exit_status(capsys):
    assert capstone.main([f"{REFERENCE}:ShortestJobFirst", "--no-engine"]) == 0
    assert "80/80" in capsys.readouterr().out
    assert capstone.main(["minivllm.core.policy:FCFS", "--no-engine"]) == 1


def test_a_class_that_is_neither_is_refused():
    with pytest.raises(ValueError, match="neither a Scheduler nor a Policy"):
        capstone.grade("minivllm.sequence:Sequence", with_engine=False)
