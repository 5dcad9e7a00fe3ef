"""The Chinese twins of the notebooks: notebooks/zh/X.ipynb teaches notebooks/X.ipynb in Chinese.

A twin has exactly its English notebook's cells in the same order: the code cells are the English
ones (source and nbval tags identical, so there is one source for the code), the markdown cells
are Chinese prose, one for each English markdown cell at the same position. The outputs of a
twin come from running the twin itself (scripts/run_notebooks.sh notebooks/zh/X.ipynb).

    python scripts/zh_twins.py check [notebooks/zh/X.ipynb ...]  # every twin when none is named
    python scripts/zh_twins.py sync  [notebooks/zh/X.ipynb ...]  # take the English code cells
    python scripts/zh_twins.py new   notebooks/X.ipynb            # start a twin (English prose)
    python scripts/zh_twins.py link  [notebooks/zh/X.ipynb ...]  # English cell 0 links to its twin

`check` exits non-zero and lists every drifted cell. `sync` copies the English code cells into
the twin: a cell whose source changed loses its outputs (re-run the twin); a code cell added in
English is inserted, and a markdown cell added in English arrives in English, which `check`
reports until it is written in Chinese.
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
TWINS = NOTEBOOKS / "zh"
_CJK = re.compile(r"[\u4e00-\u9fff]")


def english_of(twin: Path) -> Path:
    """notebooks/zh/X.ipynb -> notebooks/X.ipynb (the twin's directory's parent holds it)."""
    return twin.resolve().parent.parent / twin.name


def twin_of(english: Path) -> Path:
    return english.resolve().parent / "zh" / english.name


def all_twins() -> list[Path]:
    return sorted(TWINS.glob("[0-9][0-9]_*.ipynb"))


def _source(cell) -> str:
    return cell.source if isinstance(cell.source, str) else "".join(cell.source)


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), "")[:70]


def drift(twin: Path, english: Path | None = None) -> list[str]:
    """Every way `twin` differs from its English notebook's structure and code; [] if none."""
    english = english or english_of(twin)
    if not english.exists():
        return [f"{twin.name}: no English notebook {english}"]
    tw, en = nbformat.read(twin, as_version=4), nbformat.read(english, as_version=4)
    problems = []
    if len(tw.cells) != len(en.cells):
        problems.append(f"{len(tw.cells)} cells, the English notebook has {len(en.cells)} "
                        "(python scripts/zh_twins.py sync, then translate the new markdown)")
    for i, (t, e) in enumerate(zip(tw.cells, en.cells)):
        if t.cell_type != e.cell_type:
            problems.append(f"cell {i}: {t.cell_type}, the English cell is {e.cell_type}")
        elif e.cell_type == "code":
            if _source(t) != _source(e):
                problems.append(f"cell {i}: code differs from the English cell "
                                f"({_first_line(_source(e))!r})")
            elif _tags(t) != _tags(e):
                problems.append(f"cell {i}: tags {_tags(t)}, the English cell has {_tags(e)}")
            elif t.get("execution_count") is None:
                problems.append(f"cell {i}: not run (scripts/run_notebooks.sh {_rel(twin)})")
            elif any(out.get("output_type") == "error" for out in t.get("outputs", [])):
                problems.append(f"cell {i}: its stored output is an error (re-run the twin)")
        elif e.cell_type == "markdown" and (_source(t) == _source(e) or not _CJK.search(_source(t))):
            problems.append(f"cell {i}: markdown not written in Chinese ({_first_line(_source(t))!r})")
    if tw.cells and f"](../{english.name})" not in _source(tw.cells[0]):
        problems.append(f"cell 0: no link to the English notebook (../{english.name})")
    return [f"{_rel(twin)}: {p}" for p in problems]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _fresh_code(cell):
    cell = copy.deepcopy(cell)
    cell.outputs, cell.execution_count = [], None
    return cell


def sync(twin: Path, english: Path | None = None) -> list[str]:
    """Rewrite `twin`'s code cells from its English notebook; return what changed."""
    english = english or english_of(twin)
    tw, en = nbformat.read(twin, as_version=4), nbformat.read(english, as_version=4)

    def key(cell):  # code cells match by source; markdown cells match any markdown cell
        return (cell.cell_type, _source(cell) if cell.cell_type == "code" else "")

    matcher = difflib.SequenceMatcher(None, [key(c) for c in tw.cells], [key(c) for c in en.cells],
                                      autojunk=False)
    cells, changes = [], []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            for t, e in zip(tw.cells[i1:i2], en.cells[j1:j2]):
                if t.cell_type == "code" and _tags(t) != _tags(e):
                    t.metadata["tags"] = _tags(e)
                    changes.append(f"cell {len(cells)}: tags taken from English")
                cells.append(t)
            continue
        translated = [c for c in tw.cells[i1:i2] if c.cell_type == "markdown"]
        dropped = (sum(c.cell_type == "code" for c in tw.cells[i1:i2])
                   - sum(c.cell_type == "code" for c in en.cells[j1:j2]))
        if dropped > 0:
            changes.append(f"{dropped} code cell(s) removed in English dropped")
        for e in en.cells[j1:j2]:
            if e.cell_type == "code":
                changes.append(f"cell {len(cells)}: code taken from English, outputs cleared")
                cells.append(_fresh_code(e))
            elif translated:
                cells.append(translated.pop(0))
            else:
                changes.append(f"cell {len(cells)}: new English markdown, to be written in Chinese")
                cells.append(copy.deepcopy(e))
        if translated:
            changes.append(f"{len(translated)} markdown cell(s) without an English counterpart dropped")
    if changes:
        tw.cells = cells
        nbformat.write(tw, twin)
    return [f"{_rel(twin)}: {c}" for c in changes]


def new(english: Path) -> Path:
    """Start the twin of `english`: its cells, outputs cleared, prose still English."""
    twin = twin_of(english)
    if twin.exists():
        raise ValueError(f"{_rel(twin)} exists; use `sync` to update it")
    nb = nbformat.read(english, as_version=4)
    nb.cells = [_fresh_code(c) if c.cell_type == "code" else copy.deepcopy(c) for c in nb.cells]
    twin.parent.mkdir(exist_ok=True)
    nbformat.write(nb, twin)
    return twin


def english_link_line(twin: Path) -> str:
    return f"**English** · [中文](zh/{twin.name})"


def link_english(twin: Path) -> bool:
    """Put the link to `twin` under the title of its English notebook's first cell; True if added."""
    english = english_of(twin)
    nb = nbformat.read(english, as_version=4)
    first = nb.cells[0]
    if f"](zh/{twin.name})" in _source(first):
        return False
    title, _, rest = _source(first).partition("\n")
    first.source = f"{title}\n\n{english_link_line(twin)}\n{rest}"
    nbformat.write(nb, english)
    return True


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"check", "sync", "new", "link"}:
        print(__doc__)
        return 2
    mode, paths = argv[0], [Path(p) for p in argv[1:]]
    if mode == "new":
        for path in paths:
            print(f"started {_rel(new(path))}")
        return 0
    twins = paths or all_twins()
    if mode == "link":
        for twin in twins:
            added = link_english(twin)
            print(f"{_rel(english_of(twin))}: {'links to' if added else 'already links to'} {twin.name}")
        return 0
    if mode == "sync":
        for twin in twins:
            for line in sync(twin) or [f"{_rel(twin)}: in sync"]:
                print(line)
    problems = [p for twin in twins for p in drift(twin)]
    for problem in problems:
        print(problem)
    print(f"{len(twins)} twin(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
