"""The examples run as written (examples/*.py)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_extension_points_example(capsys):
    runpy.run_path(str(EXAMPLES / "extension_points.py"), run_name="example")["main"]()
    lines = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("1.", "2.", "3.", "4.", "5.")]
    assert len(lines) == 5
    assert "same tokens: True" in lines[2]
    assert lines[3].endswith("[7, 3]")  # LLM.generate answers in input order, whatever ran first
    assert int(lines[4].rsplit(":", 1)[1]) > 0  # a restart found the prompt's blocks
