"""The README stays a short page for users: under 150 lines, CPU-first install, the exact test
command CI runs, one notebook row per notebook, and links that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_LINES = 150
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
TEST_COMMAND = 'pip install -e ".[dev]" && pytest'  # .ci/run runs this line verbatim


def test_readme_is_under_150_lines():
    assert len(README.splitlines()) < MAX_LINES, "move the detail into docs/ (docs/usage.md)"


def test_quickstart_installs_cpu_torch_first_then_generates_then_tests():
    cpu, generate, tests = (README.index(s) for s in (CPU_TORCH, 'pip install -e . && minivllm generate "ROMEO:"',
                                                      TEST_COMMAND))
    assert cpu < generate < tests


def test_ci_runs_the_readmes_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert TEST_COMMAND in README and ci.rstrip().splitlines()[-1] == TEST_COMMAND


def test_the_site_home_pages_install_cpu_torch_first():
    for page in ("docs/index.md", "docs/zh/index.md", "docs/usage.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert CPU_TORCH in text and text.index(CPU_TORCH) < text.index("pip install -e ."), page


def test_the_notebook_table_has_one_row_per_notebook():
    rows = re.findall(r"^\| (\d\d) \| \[[^\]]+\]\(notebooks/(\d\d_\w+\.ipynb)\)", README, flags=re.M)
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [name for _, name in rows] == notebooks
    assert all(name.startswith(number) for number, name in rows)


def test_relative_links_lead_to_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_benchmark_figures_come_with_their_page():
    section = README.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in section.splitlines() if line.startswith("| "))
    assert "docs/benchmarks.md" in section and "peer" in header and "GPU" in header


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def _run_on_the_cpu(code: str, filename: str) -> dict:
    """Run an example as written, its `LLM()` on the CPU (on a GPU machine a default engine
    would take most of the GPU's memory from the tests that run after it)."""
    assert "LLM()" in code, filename
    namespace: dict = {}
    exec(compile(code.replace("LLM()", 'LLM(device="cpu")'), filename, "exec"), namespace)
    return namespace


def test_the_api_in_30_seconds_runs_as_written(capsys):
    section = README.split("## The API in 30 seconds", 1)[1].split("\n## ", 1)[0]
    [code] = _python_blocks(section)
    _run_on_the_cpu(code, "README.md")
    out = capsys.readouterr().out
    assert out.startswith("'ROMEO:' -> ") and "\n'JULIET:' -> " in out
    assert re.search(r"^r0 ['\"].+['\"]$", out, flags=re.M), "the engine loop printed its finished request"


def test_the_usage_pages_from_python_example_runs_as_written():
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    section = usage.split("## From Python", 1)[1].split("\n## ", 1)[0]
    namespace = _run_on_the_cpu(_python_blocks(section)[0], "docs/usage.md")
    line, reply = namespace["line"], namespace["reply"]
    assert line.outputs[0].finish_reason == "stop" and "\n" not in line.outputs[0].text
    assert reply.outputs[0].text


def _github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_docs_name_a_heading_there():
    for target, anchor in re.findall(r"\]\((docs/[^)#]+\.md)#([^)]+)\)", README):
        headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(encoding="utf-8"), flags=re.M)
        assert anchor in {_github_slug(h) for h in headings}, f"{target}#{anchor}"
