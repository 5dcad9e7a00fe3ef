"""Regenerate docs/img/call_graph.png from a real run: `python scripts/draw_call_graph.py`."""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from minivllm import LLM  # noqa: E402
from minivllm.viz import calltrace  # noqa: E402

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "docs/img/call_graph.png"
run, setup = calltrace.record_llm_generate(lambda: LLM(seed=0, device="cpu"))
calltrace.figure(run, setup).savefig(out, dpi=100, bbox_inches="tight")
print(f"wrote {out}")
