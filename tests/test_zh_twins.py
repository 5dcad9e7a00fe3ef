"""The Chinese twins (notebooks/zh/) carry their English notebooks' code cells unchanged.

scripts/zh_twins.py holds the rule; this runs its `check` on every twin (no execution: nbval runs
the twins like any other notebook) and shows that the check catches drift and `sync` repairs it.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from types import SimpleNamespace
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("zh_twins", REPO / "scripts" / "zh_twins.py")
zh_twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zh_twins)

TWINS = zh_twins.all_twins()


def test_there_are_twins_and_each_has_an_english_notebook():
    assert TWINS, "no notebooks/zh/NN_*.ipynb"
    assert [t.name for t in TWINS if not zh_twins.english_of(t).exists()] == []


@pytest.mark.parametrize("twin", TWINS, ids=[t.stem for t in TWINS])
def test_twin_has_the_english_code_and_chinese_prose(twin):
    assert zh_twins.drift(twin) == []


def _run(cell):
    cell.execution_count = 1
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ok\n")]
    return cell


@pytest.fixture
def copied_twin(tmp_path):
    """A small English notebook in tmp_path/ and its twin, in sync and run, in tmp_path/zh/."""
    name = "99_example.ipynb"
    code = ["import math", "x = math.sqrt(2)\nprint(x)", "# NBVAL_IGNORE_OUTPUT\nprint(x * x)"]
    english = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 99 · An example\n\n*One line.*"), _run(nbformat.v4.new_code_cell(code[0])),
        nbformat.v4.new_markdown_cell("Take a square root."), _run(nbformat.v4.new_code_cell(code[1])),
        nbformat.v4.new_markdown_cell("Square it again."), _run(nbformat.v4.new_code_cell(code[2]))])
    twin = copy.deepcopy(english)
    for cell, text in zip([c for c in twin.cells if c.cell_type == "markdown"],
                          [f"# 99 · 一个例子\n\n**中文** · [English](../{name})", "开平方。", "再平方回去。"]):
        cell.source = text
    (tmp_path / "zh").mkdir()
    nbformat.write(english, tmp_path / name)
    nbformat.write(twin, tmp_path / "zh" / name)
    assert zh_twins.drift(tmp_path / "zh" / name, tmp_path / name) == []
    return tmp_path / "zh" / name, tmp_path / name


def _code_indices(nb):
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def test_check_lists_each_drifted_code_cell_and_sync_restores_it(copied_twin):
    twin, english = copied_twin
    nb = nbformat.read(twin, as_version=4)
    first, last = _code_indices(nb)[0], _code_indices(nb)[-1]
    nb.cells[first].source += "\nx = 1"
    nb.cells[last].source = "print('edited in the twin')"
    nbformat.write(nb, twin)

    problems = zh_twins.drift(twin, english)
    assert [p.split(": ")[1] for p in problems] == [f"cell {first}", f"cell {last}"]
    assert all("code differs from the English cell" in p for p in problems)

    changed = zh_twins.sync(twin, english)
    assert len(changed) == 2
    synced = nbformat.read(twin, as_version=4)
    assert [c.source for c in synced.cells if c.cell_type == "code"] == \
           [c.source for c in nbformat.read(english, as_version=4).cells if c.cell_type == "code"]
    # The re-taken cells lose their outputs: the twin must be re-run before it checks clean.
    assert [p.split(": ")[1:] for p in zh_twins.drift(twin, english)] == \
           [[f"cell {i}", "not run (scripts/run_notebooks.sh " + str(twin) + ")"] for i in (first, last)]


def test_sync_inserts_new_english_cells_and_check_asks_for_their_translation(copied_twin):
    twin, english = copied_twin
    translated = [c.source for c in nbformat.read(twin, as_version=4).cells if c.cell_type == "markdown"]
    en = nbformat.read(english, as_version=4)
    at = _code_indices(en)[1]
    en.cells.insert(at, nbformat.v4.new_code_cell("y = 2"))
    en.cells.insert(at, nbformat.v4.new_markdown_cell("A new explanation."))
    nbformat.write(en, english)
    assert "cells, the English notebook has" in zh_twins.drift(twin, english)[0]

    zh_twins.sync(twin, english)
    problems = zh_twins.drift(twin, english)
    assert [p.split(": ", 1)[1] for p in problems] == [
        f"cell {at}: markdown not written in Chinese ('A new explanation.')",
        f"cell {at + 1}: not run (scripts/run_notebooks.sh {twin})",
    ]
    nb = nbformat.read(twin, as_version=4)
    assert [c.cell_type for c in nb.cells] == [c.cell_type for c in en.cells]
    # Every translated markdown cell is still there, in order.
    assert [c.source for c in nb.cells if c.cell_type == "markdown" and c.source != "A new explanation."] == translated


def test_a_twin_links_to_its_english_notebook(copied_twin):
    twin, english = copied_twin
    nb = nbformat.read(twin, as_version=4)
    nb.cells[0].source = nb.cells[0].source.replace(f"](../{english.name})", "](elsewhere.ipynb)")
    nbformat.write(nb, twin)
    assert zh_twins.drift(twin, english) == [
        f"{twin}: cell 0: no link to the English notebook (../{english.name})"]


def test_link_puts_the_twin_under_the_english_title_once(copied_twin):
    twin, english = copied_twin
    assert zh_twins.link_english(twin) is True
    assert zh_twins.link_english(twin) is False  # idempotent
    first = nbformat.read(english, as_version=4).cells[0].source.splitlines()
    assert first[0].startswith("# ") and first[2] == f"**English** · [中文](zh/{twin.name})"
    assert zh_twins.drift(twin, english) == []  # prose only: the twin is still in sync


def test_the_site_lists_every_twin_and_links_it_to_the_docs():
    # mkdocs.yml's validation makes a twin left out of the nav fail the strict build.
    nav = set(re.findall(r"^\s+- notebooks/zh/(\S+\.ipynb)$", (REPO / "mkdocs.yml").read_text(encoding="utf-8"), re.M))
    assert nav == {t.name for t in TWINS}
    spec = importlib.util.spec_from_file_location("links_hook", REPO / "docs" / "hooks" / "links.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="notebooks/zh/00_tour.ipynb"))
    html = '<a href="../../docs/zh/interview.md#x">a</a><a href="../../docs/modules.md">b</a>'
    assert hook.on_post_page(html, page, None) == '<a href="../../../zh/interview/#x">a</a><a href="../../../modules/">b</a>'
