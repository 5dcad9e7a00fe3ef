"""The project reads as a textbook: it speaks of itself as it is, in short docstrings.

1. No history words in `minivllm/`, `kernels/`, `README.md`, `docs/` or the notebooks' markdown
   cells: work-session and issue numbers, "used to be", "before the fix", "the first design",
   commit hashes in prose. History belongs in git log. `docs/benchmarks.md`'s result tables
   may name the commit each figure was measured at; the words are banned there too.
2. Every module, class and function docstring of `minivllm/` and `kernels/` is at most
   `MAX_DOCSTRING_LINES` lines: docstrings draw the data (shapes, invariants, the vLLM file
   mirrored); explanations belong in `docs/architecture.md` and the notebooks.

Each test lists every offending file:line, so one run shows all there is to fix.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_DIRS = ("minivllm", "kernels")
MAX_DOCSTRING_LINES = 25

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    r"\d+(?:st|nd|rd|th)"
)
# (name, pattern): precise phrases, so that "is used to compute", a hex colour or a sha256 in a
# cache key never matches.
HISTORY_WORDS: tuple[tuple[str, re.Pattern], ...] = (
    ("ordinal session", re.compile(rf"\b(?:{_ORDINALS})[ -]session\b", re.IGNORECASE)),
    ("ordinal session (zh)",
     re.compile(r"第\s*[0-9一二三四五六七八九十]+\s*[次轮个]?\s*(?:会话|session)", re.IGNORECASE)),
    ("session number", re.compile(r"\bsessions?\s+(?:#\s?)?\d+\b", re.IGNORECASE)),
    ("issue number", re.compile(r"\bissues?\s+(?:#\s?)?\d+\b", re.IGNORECASE)),
    ("used to be", re.compile(r"\bused to be\b", re.IGNORECASE)),
    # "X used to Y" as a past habit, where X is a pronoun or a `code name`; a participle ("the
    # channel, used to notice ...") or a passive ("is used to compute") is ordinary prose.
    ("used to (past habit)", re.compile(
        r"(?:\b(?:we|it|they|this|that|there|which|he|she|you)|`)\s+(?:once\s+|always\s+)?used to\b",
        re.IGNORECASE)),
    ("before/after the fix", re.compile(r"\b(?:before|after)\s+(?:the|this|that)\s+fix\b", re.IGNORECASE)),
    ("before/after this change",
     re.compile(r"\b(?:before|after)\s+(?:this|that|the)\s+change\b", re.IGNORECASE)),
    ("the first design", re.compile(r"\bthe\s+(?:first|original|old|earlier)\s+design\b", re.IGNORECASE)),
)
# A commit hash: 7 to 40 hex digits with at least one digit and one letter, standing alone (not
# a hex colour "#1f77b4cc", not "0x...", not a piece of a UUID or of a longer hex digest), or any
# 7 to 40 hex digits right after the word "commit".
COMMIT_HASH = re.compile(
    r"(?<![#\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])"
    r"|\b(?i:commits?)\s+[0-9a-f]{7,40}\b")


def history_hits(text: str, *, hashes: bool = True) -> list[str]:
    """The names of the history patterns `text` (one line) contains."""
    hits = [name for name, pattern in HISTORY_WORDS if pattern.search(text)]
    if hashes and COMMIT_HASH.search(text):
        hits.append("commit hash")
    return hits


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _code_files() -> list[Path]:
    files = []
    for folder in CODE_DIRS:
        for suffix in ("*.py", "*.md"):
            files += (REPO / folder).rglob(suffix)
    return sorted(files)


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _notebook_markdown(path: Path) -> list[tuple[str, str]]:
    """(where, line) for every line of the notebook's markdown cells."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lines = []
    for number, cell in enumerate(cells):
        if cell.get("cell_type") != "markdown":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        for lineno, line in enumerate(source.splitlines(), 1):
            lines.append((f"{_rel(path)}:cell {number}:{lineno}", line))
    return lines


def _is_result_table_line(path: Path, line: str) -> bool:
    """A row of docs/benchmarks.md's result tables, which name the commit each figure ran at."""
    return path.name == "benchmarks.md" and line.lstrip().startswith("|")


def _text_lines() -> list[tuple[str, str, bool]]:
    """(where, line, check hashes) for every line the history test reads."""
    lines = []
    for path in _code_files() + _doc_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            lines.append((f"{_rel(path)}:{lineno}", line, not _is_result_table_line(path, line)))
    for path in sorted((REPO / "notebooks").rglob("*.ipynb")):
        lines += [(where, line, True) for where, line in _notebook_markdown(path)]
    return lines


def test_history_patterns_catch_history_and_spare_ordinary_prose():
    caught = [
        "docs/benchmarks.md, eleventh session", "the 8th session began at 11,468", "in session 9",
        "as issue 15 asked", "see issue #33", "the `Sampler` used to process rows", "it used to take",
        "this used to be slow", "before the fix it hung", "the first design handed step s over",
        "after this change the GPU waits less", "第十一次会话的测量", "at commit 5610666 the run", "(7e8e58e)",
    ]
    spared = [
        "the receive channel, used to notice a client that hangs up", "is used to compute the mask",
        "ClientSession()", "a session of the notebook", "this issue's tests", "color='#1f77b4cc'",
        "key = sha256(data).hexdigest()[:16]", "0x9E3779B97F4A7C15", "1234567 tokens", "deadbeef",
        "Fixed a commit message", "the cache's content hash 3f2a", "123e4567-e89b-12d3-a456-426614174000", "a fix for preemption", "the design of the cache",
    ]
    assert [text for text in caught if not history_hits(text)] == []
    assert [(text, history_hits(text)) for text in spared if history_hits(text)] == []


def test_no_history_words_in_code_docs_or_notebooks():
    """The project speaks of itself as it is: history lives in git log."""
    offending = [
        f"{where}: {', '.join(hits)}: {line.strip()[:120]}"
        for where, line, hashes in _text_lines()
        if (hits := history_hits(line, hashes=hashes))
    ]
    assert not offending, f"{len(offending)} lines with history words:\n" + "\n".join(offending)


def _docstrings(path: Path):
    """(line, name, number of lines) of the module's, every class's and every function's docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        if docstring is not None:
            yield node.body[0].lineno, getattr(node, "name", "module"), len(docstring.splitlines())


def test_docstrings_are_at_most_25_lines():
    """Docstrings draw the data; explanations go to docs/architecture.md and the notebooks."""
    offending = [
        f"{_rel(path)}:{lineno}: {name}: {count} lines"
        for path in _code_files() if path.suffix == ".py"
        for lineno, name, count in _docstrings(path)
        if count > MAX_DOCSTRING_LINES
    ]
    assert not offending, (
        f"{len(offending)} docstrings over {MAX_DOCSTRING_LINES} lines:\n" + "\n".join(offending)
    )
