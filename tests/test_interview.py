"""The interview answers (docs/interview.md, docs/zh/interview.md) and their index (docs/questions.md,
docs/zh/questions.md) hold together.

An answer is what a learner says in about 30 seconds:
- Chinese: the paragraph that starts with "答：", at most 150 Chinese characters. Counting rule: only Han
  ideographs count (CJK Unified Ideographs, Extension A, Compatibility Ideographs); code names,
  Latin words, numbers and punctuation do not.
- English: the paragraph under the question, at most 100 words.
The → line (pointers to notebooks and code) and the optional measured line are not part of it.
The two pages are twins: the same sections, the same questions (by anchor) in the same order, and a
measured line in one language only where the other has it. A measured line names its GPU and takes
its figures from docs/benchmarks.md. Every index row links to an existing answer anchor, notebook
section and minivllm file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_HAN = 150
MAX_WORDS = 100
HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
QUESTION = re.compile(r"^### (?P<q>.+?) \{#(?P<id>[a-z0-9-]+)\}$")
MEASURED = {"zh": "minivllm 实测：", "en": "Measured in minivllm: "}
INDEX_ROW = re.compile(r"^\| \[(?P<q>.+)\]\(interview\.md#(?P<id>[a-z0-9-]+)\) \| \[(?P<nb>\d\d) §(?P<sec>\d+)\]"
                       r"\((?:\.\./)+notebooks/(?P<file>(?:zh/)?[\w.-]+\.ipynb)\) \| `(?P<mini>[^`]+)` \| `(?P<vllm>[^`]+)` \|$")


def han_count(text: str) -> int:
    """Chinese characters in `text`: Han ideographs only, so code names, numbers and punctuation are free."""
    return len(HAN.findall(text))


def parse(path: Path) -> list[tuple[str, list[dict]]]:
    """[(section heading, [{"id", "q", "answer", "pointer", "measured"}, ...]), ...] of an interview page."""
    sections: list[tuple[str, list[dict]]] = []
    question = None
    for paragraph in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
        lines = paragraph.strip("\n").splitlines()
        if not lines:
            continue
        if lines[0].startswith("## "):
            sections.append((lines[0][3:], []))
            question = None
            continue
        match = QUESTION.match(lines[0])
        if match:
            question = {"id": match["id"], "q": match["q"], "answer": None, "pointer": None, "measured": None}
            sections[-1][1].append(question)
            continue
        if question is None:
            continue
        lang = "zh" if "/zh/" in str(path) else "en"
        if lines[0].startswith(MEASURED[lang]):
            question["measured"] = paragraph
        elif question["answer"] is None and not lines[0].startswith("```"):
            body = [line for line in lines if not line.startswith("→")]
            question["answer"] = " ".join(body)
            question["pointer"] = next((line for line in lines if line.startswith("→")), None)
    return sections


ZH = parse(DOCS / "zh" / "interview.md")
EN = parse(DOCS / "interview.md")


def test_counting_rule():
    assert han_count("`slot_mapping` 是 2 个槽位，约 75%。") == 5
    assert han_count("PagedAttention, block table, 0.88×") == 0


@pytest.mark.parametrize("lang, sections", [("zh", ZH), ("en", EN)])
def test_every_question_has_an_answer_and_a_pointer(lang, sections):
    questions = [q for _, qs in sections for q in qs]
    assert len(questions) >= 100
    for q in questions:
        assert q["answer"], f"{lang} {q['id']}: no answer paragraph"
        assert q["pointer"], f"{lang} {q['id']}: no → line pointing to a notebook or the code"
        if lang == "zh":
            assert q["answer"].startswith("答："), f"zh {q['id']}: the answer starts with 答："


def test_chinese_answers_fit_150_characters():
    too_long = {q["id"]: han_count(q["answer"]) for _, qs in ZH for q in qs if han_count(q["answer"]) > MAX_HAN}
    assert not too_long, f"Chinese answers over {MAX_HAN} Chinese characters: {too_long}"


NOTEBOOK_ANSWER = "**面试标准答案（约 30 秒）。**"


def test_the_notebooks_answers_to_recite_fit_150_characters():
    """A notebook's "answer to recite" in Chinese (00's tour answer) obeys the pages' limit too."""
    too_long = {}
    for notebook in sorted((ROOT / "notebooks").glob("**/*.ipynb")):
        for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
            for paragraph in "".join(cell["source"]).split("\n\n"):
                if paragraph.startswith(NOTEBOOK_ANSWER):
                    count = han_count(paragraph[len(NOTEBOOK_ANSWER):])
                    if count > MAX_HAN:
                        too_long[notebook.relative_to(ROOT).as_posix()] = count
    assert not too_long, f"answers over {MAX_HAN} Chinese characters: {too_long}"


def test_english_answers_fit_100_words():
    too_long = {q["id"]: len(q["answer"].split()) for _, qs in EN for q in qs if len(q["answer"].split()) > MAX_WORDS}
    assert not too_long, f"English answers over {MAX_WORDS} words: {too_long}"


def test_the_two_pages_are_twins():
    assert len(ZH) == len(EN), "both pages have the same sections"
    for (zh_head, zh_qs), (en_head, en_qs) in zip(ZH, EN):
        assert len(zh_qs) == len(en_qs), f"{zh_head} / {en_head}: {len(zh_qs)} vs {len(en_qs)} questions"
        assert [q["id"] for q in zh_qs] == [q["id"] for q in en_qs], f"{zh_head} / {en_head}: questions in another order"
        for zq, eq in zip(zh_qs, en_qs):
            assert bool(zq["measured"]) == bool(eq["measured"]), f"{zq['id']}: a measured line in one language only"
    ids = [q["id"] for _, qs in ZH for q in qs]
    assert len(ids) == len(set(ids)), "anchors are unique"


def test_measured_lines_come_from_benchmarks():
    benchmarks = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    lines = [q["measured"] for sections in (ZH, EN) for _, qs in sections for q in qs if q["measured"]]
    assert lines
    for line in lines:
        assert re.search(r"\bH(100|200)\b", line), f"a measured line names its GPU: {line}"
        assert "benchmarks.md#" in line, f"a measured line links to its benchmark: {line}"
        text = re.sub(r"\([^)]*benchmarks\.md[^)]*\)", "", line)
        for figure in re.findall(r"\d[\d,.]*\d|\d", text):
            assert figure in benchmarks, f"{figure} (in {line!r}) is not a figure of docs/benchmarks.md"


def _notebook_sections(name: str) -> set[str]:
    cells = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return set(re.findall(r"(?m)^## (\d+)\. ", text))


@pytest.mark.parametrize("lang, index, sections", [("en", DOCS / "questions.md", EN),
                                                   ("zh", DOCS / "zh" / "questions.md", ZH)])
def test_index_rows_point_to_answers_notebooks_and_files(lang, index, sections):
    answers = {q["id"]: q["q"] for _, qs in sections for q in qs}
    rows = [line for line in index.read_text(encoding="utf-8").splitlines()
            if line.startswith("| [")]
    seen = []
    for row in rows:
        match = INDEX_ROW.match(row)
        assert match, f"{lang} index row not in the form | [question](interview.md#id) | [NN §k](notebook) | `file` | `file` |: {row}"
        assert match["id"] in answers, f"{lang} index: no answer with anchor #{match['id']}"
        assert match["q"].replace("\\|", "|") == answers[match["id"]], f"{index.name}: row #{match['id']} must repeat the question as {lang} interview.md asks it"
        assert Path(match["file"]).name.startswith(match["nb"] + "_") and (ROOT / "notebooks" / match["file"]).exists(), row
        assert match["sec"] in _notebook_sections(match["file"]), f"{match['file']} has no section {match['sec']}"
        assert (ROOT / match["mini"]).exists(), f"{lang} index: {match['mini']} does not exist"
        assert re.fullmatch(r"(vllm|csrc|tests|benchmarks)/[\w/.-]+\.(py|cu)", match["vllm"]), match["vllm"]
        seen.append(match["id"])
    assert seen == list(answers), f"{lang} index: every question once, in the pages' order"


def _source() -> str:
    files = [p for d in ("minivllm", "kernels", "benchmarks", "examples", "tests") for p in (ROOT / d).rglob("*.py")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_pointers_name_code_that_exists():
    """Every `name` on a → line is a file, a flag, or a function / class / attribute defined in the code."""
    source = _source()
    missing = set()
    for sections in (ZH, EN):
        for _, qs in sections:
            for q in qs:
                for name in re.findall(r"`([^`]+)`", q["pointer"]):
                    if name.startswith("--"):
                        ok = name in source
                    elif "/" in name or name.endswith(".py"):
                        ok = (ROOT / name).exists() or any(next((ROOT / d).rglob(name), None) for d in ("minivllm", "kernels"))
                    elif " " in name:
                        ok = True  # a command line such as `minivllm proxy`
                    else:
                        parts = re.findall(r"[A-Za-z_]\w*", name.split("(")[0])
                        ok = bool(parts) and all(re.search(rf"\b{p}\b", source) for p in parts) and bool(
                            re.search(rf"\b(def|class)\s+{parts[-1]}\b|\b{parts[-1]}\s*[:=]", source))
                    if not ok:
                        missing.add(name)
    assert not missing, f"pointers to code that does not exist (renamed or moved?): {sorted(missing)}"
