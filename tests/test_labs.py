"""The labs' learner copies (`scripts/make_learner_labs.py`): every cell that does not call the
learner's code runs on the skeleton, and every `check` cell fails on it (a check that passes on
an empty skeleton checks nothing). The committed labs, solutions in, run under nbval."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAB_NOTEBOOKS = sorted((ROOT / "notebooks" / "labs").glob("lab*.ipynb"))

_spec = importlib.util.spec_from_file_location("make_learner_labs", ROOT / "scripts" / "make_learner_labs.py")
make_learner_labs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_learner_labs)


def test_strip_solutions_keeps_the_signature_and_stubs_the_body():
    source = "def area(w, h):\n    \"\"\"w x h.\"\"\"\n    ### BEGIN SOLUTION\n    return w * h\n    ### END SOLUTION\n"
    stub = make_learner_labs.strip_solutions(source)
    assert "return w * h" not in stub
    assert stub.splitlines() == ["def area(w, h):", '    """w x h."""', "    # YOUR CODE HERE",
                                 '    raise NotImplementedError("write `area`")']
    namespace: dict = {}
    exec(stub, namespace)
    with pytest.raises(NotImplementedError, match="area"):
        namespace["area"](2, 3)


@pytest.mark.parametrize("source", ["### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION\n",
                                    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n"])
def test_unbalanced_markers_are_refused(source):
    with pytest.raises(ValueError):
        make_learner_labs.strip_solutions(source)


def test_there_are_ten_labs_and_each_has_a_solution_and_a_check():
    assert len(LAB_NOTEBOOKS) >= 10, [p.name for p in LAB_NOTEBOOKS]
    for path in LAB_NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        code = [c for c in cells if c.cell_type == "code"]
        assert any(make_learner_labs.BEGIN in c.source for c in code), f"{path.name}: no solution region"
        assert any("check" in c.metadata.get("tags", []) for c in code), f"{path.name}: no cell tagged check"


@pytest.mark.parametrize("path", LAB_NOTEBOOKS, ids=lambda p: p.stem)
def test_learner_copy_runs_to_its_checks_and_every_check_fails(path, tmp_path):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    make_learner_labs.write_learner_labs(tmp_path, labs=path.parent)
    notebook = nbformat.read(tmp_path / path.name, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    passed_checks, broken_cells = [], []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with client.setup_kernel(env=env):
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code":
                continue
            is_check = "check" in cell.metadata.get("tags", [])
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as error:
                if not is_check:
                    broken_cells.append((index, str(error).splitlines()[-1]))
            else:
                if is_check:
                    passed_checks.append(index)
    assert not broken_cells, f"{path.name}: cells that do not call the learner's code failed: {broken_cells}"
    assert not passed_checks, f"{path.name}: check cells passed on the empty skeleton: {passed_checks}"
