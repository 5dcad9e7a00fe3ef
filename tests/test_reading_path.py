"""The reading path of docs/architecture.md: the files of the plain single-device engine, from
`LLM.generate` down to the kernels, in reading order. Each listed file exists, and together they
stay at or under `MAX_LINES` lines, docstrings, comments and blank lines included (`wc -l`)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADING = "## Reading path"
MAX_LINES = 5_000
# A list item that opens with one backticked path: "1. `minivllm/x.py` — what to look for".
ITEM = re.compile(r"^\s*(?:\d+\.|[-*])\s+`([^`]+)`")
# The spine of the path: leaving any of these out would shorten the path, not the code.
REQUIRED = {
    "minivllm/entrypoints/llm.py", "minivllm/engine/llm_engine.py", "minivllm/sequence.py",
    "minivllm/core/scheduler.py", "minivllm/core/block_manager.py", "minivllm/worker/worker.py",
    "minivllm/worker/cache_engine.py", "minivllm/worker/model_runner.py",
    "minivllm/model_executor/models/llama.py", "minivllm/model_executor/layers/sampler.py",
    "minivllm/attention/layer.py", "kernels/paged_attention.py",
}


def reading_path() -> list[str]:
    lines = ARCHITECTURE.read_text(encoding="utf-8").splitlines()
    assert HEADING in lines, f"docs/architecture.md has no '{HEADING}' section"
    paths = []
    for line in lines[lines.index(HEADING) + 1:]:
        if line.startswith("## "):
            break
        match = ITEM.match(line)
        if match:
            paths.append(match.group(1))
    return paths


def line_count(path: str) -> int:
    with open(ROOT / path, "rb") as f:
        return sum(1 for _ in f)


def test_every_file_exists_once():
    paths = reading_path()
    assert len(paths) >= len(REQUIRED), paths
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"the reading path names files that do not exist: {missing}"
    duplicates = sorted({p for p in paths if paths.count(p) > 1})
    assert not duplicates, f"listed twice: {duplicates}"


def test_the_spine_is_on_the_path():
    left_out = sorted(REQUIRED - set(reading_path()))
    assert not left_out, f"the reading path leaves out {left_out}"


def test_total_lines_within_budget():
    counts = {p: line_count(p) for p in reading_path()}
    total = sum(counts.values())
    table = "\n".join(f"{n:6d}  {p}" for p, n in counts.items())
    assert total <= MAX_LINES, f"the reading path is {total} lines, over {MAX_LINES}:\n{table}"
