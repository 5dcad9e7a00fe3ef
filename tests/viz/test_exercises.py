"""Every exercise's hidden solution passes its checker, and every checker catches a wrong answer.

The solutions live in the notebooks (a folded `<details>` cell under each exercise); this test
runs them, so a solution that drifts from its checker (or a checker that drifts from the code it
checks) fails CI. docs/exercises.md must list every exercise.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import nbformat
import pytest
import torch

import minivllm.viz.exercises as exercises

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHECKERS = {name: fn for name, fn in inspect.getmembers(exercises, inspect.isfunction) if name.startswith("check_")}
_SOLUTION = re.compile(r"<details><summary>Solution.*?```python\n(.*?)```", re.S)


def _solutions() -> list[tuple[str, str]]:
    found = []
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, 4).cells:
            if cell.cell_type == "markdown" and "exercise" in cell.metadata.get("tags", []):
                found += [(path.stem, code) for code in _SOLUTION.findall(cell.source)]
    return found


SOLUTIONS = _solutions()


def test_every_checker_has_a_solution_in_a_notebook():
    used = {name for _, code in SOLUTIONS for name in CHECKERS if name + "(" in code}
    assert used == set(CHECKERS), f"checkers without a solution: {set(CHECKERS) - used}"


@pytest.mark.parametrize("notebook, code", SOLUTIONS, ids=[f"{nb}-{i}" for i, (nb, _) in enumerate(SOLUTIONS)])
def test_solution_passes_its_checker(notebook, code, capsys):
    namespace = {"torch": torch, "math": math, **CHECKERS}
    exec(compile(code, f"<solution in {notebook}>", "exec"), namespace)  # the solution asserts its check
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_checker_rejects_a_stub_and_a_wrong_answer(name, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError

    def wrong(*args, **kwargs):
        return None

    if next(iter(inspect.signature(CHECKERS[name]).parameters)) in ("answer", "prediction"):  # takes a value
        assert not CHECKERS[name](NotImplemented) and not CHECKERS[name](["LLMEngine.step"])
    else:
        assert not CHECKERS[name](stub) and not CHECKERS[name](wrong)
    out = capsys.readouterr().out
    assert "not written yet" in out and out.count("✗") == 2


def test_a_wrong_slot_owner_is_explained(capsys):
    def forgets_lengths(tables, lengths, slot, bs):  # a slot past a sequence's last token still "belongs" to it
        for name, table in tables.items():
            if slot // bs in table:
                return name, table.index(slot // bs) * bs + slot % bs
        return None
    assert not exercises.check_slot_owner(forgets_lengths)
    out = capsys.readouterr().out
    assert "block_size=4" in out and "expected" in out and "got" in out


def test_the_index_lists_every_exercise():
    index = (ROOT / "docs/exercises.md").read_text(encoding="utf-8")
    for name in CHECKERS:
        assert f"`{name}`" in index, f"docs/exercises.md does not list {name}"
