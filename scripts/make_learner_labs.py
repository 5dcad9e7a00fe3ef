"""Write the learner's copies of the labs: every solution region removed, outputs cleared.

    python scripts/make_learner_labs.py            # notebooks/labs/ -> my_labs/
    python scripts/make_learner_labs.py --out DIR

The committed labs (`notebooks/labs/`) hold their reference solutions between nbgrader's markers,
so nbval runs them; in the copy each marked region becomes, at the same indent,

    # YOUR CODE HERE
    raise NotImplementedError("write `<the enclosing function>`")

Other files of the folder (the capstone's page) are copied as they are. `tests/test_labs.py`
runs the copies: cells tagged `check` must fail on the skeleton, every other cell must run.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "notebooks" / "labs"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)|^\s*class\s+(\w+)")


def strip_solutions(source: str) -> str:
    """`source` with each BEGIN/END SOLUTION region replaced by a stub; ValueError if unbalanced."""
    out: list[str] = []
    inside = False
    for line in source.splitlines():
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{BEGIN} inside a solution region")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}# YOUR CODE HERE", f'{indent}raise NotImplementedError("{_what(out)}")']
        elif marker == END:
            if not inside:
                raise ValueError(f"{END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN} without {END}")
    return "\n".join(out)


def _what(lines_before: list[str]) -> str:
    for line in reversed(lines_before):
        match = _DEF.match(line)
        if match:
            return f"write `{match.group(1) or match.group(2)}`"
    return "write this part"


def learner_copy(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    copy = nbformat.from_dict(notebook)
    for cell in copy.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs, cell.execution_count = [], None
    return copy


def write_learner_labs(out: Path, labs: Path = LABS) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(labs.iterdir()):
        target = out / path.name
        if path.suffix == ".ipynb":
            nbformat.write(learner_copy(nbformat.read(path, as_version=4)), target)
        elif path.is_file():
            shutil.copyfile(path, target)
        else:
            continue
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "my_labs", help="where the copies go (default: my_labs/)")
    args = parser.parse_args()
    for path in write_learner_labs(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
