"""The plain path stays plain: the single-GPU, single-step engine's four files branch on no mode.

`llm_engine.py`, `core/scheduler.py`, `worker/worker.py` and `worker/model_runner.py` are what a
reader opens first; every optional mode (multi-step, async scheduling, speculative decoding, KV
transfer, pipeline stages, LoRA) wraps them in a file of its own, chosen once at construction.
The test parses the four files and counts the branch conditions that mention a mode's settings;
mode-only data travels in the modes' own types, never in fields of the shared ones.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from minivllm.sequence import ExecuteModelRequest, SamplerOutput

PACKAGE = Path(__file__).resolve().parents[1] / "minivllm"
PLAIN_FILES = ("engine/llm_engine.py", "core/scheduler.py", "worker/worker.py", "worker/model_runner.py")
MAX_MODE_BRANCHES = 4

# Substrings of a condition's source that name a mode's setting or data.
MODE_WORDS = (
    "num_scheduler_steps", "num_steps", "multi_step", "async_scheduling", "schedule_ahead",
    "speculative", "spec_decode", "kv_transfer", "kv_connector", "pipeline", "pp_rank", "pp_group",
    "is_first_rank", "is_last_rank", "lora", "lookahead", "steps_left", "continues_previous_run",
)
MODE_ONLY_FIELDS = {"spec_decode_worker_metrics", "kv_transfer_stats", "steps_left", "continues_previous_run"}


def branch_conditions(tree: ast.AST) -> list[ast.expr]:
    """Every condition a branch tests: if / elif, ternaries, while, assert, comprehension ifs."""
    conditions = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            conditions.append(node.test)
        elif isinstance(node, ast.comprehension):
            conditions.extend(node.ifs)
    return conditions


def condition_without_arguments(condition: ast.expr) -> str:
    """The condition's source without the arguments of its calls: `room_for(seq, lookahead)` tests
    whether there is room, not a mode; `self.lora_slots.admits(...)` names its extension point."""
    condition = ast.parse(ast.unparse(condition), mode="eval").body  # a copy to strip
    for node in ast.walk(condition):
        if isinstance(node, ast.Call):
            node.args, node.keywords = [], []
    return ast.unparse(condition)


def mode_branches(source: str) -> list[tuple[int, str]]:
    """(line, condition) of each branch whose tested names mention a mode word."""
    found = []
    for condition in branch_conditions(ast.parse(source)):
        text = condition_without_arguments(condition)
        if any(word in text.lower() for word in MODE_WORDS):
            found.append((condition.lineno, text))
    return sorted(found)


def test_the_counter_sees_every_kind_of_branch():
    source = """
if self.lora_config is not None: pass
elif num_steps > 1: pass
x = 1 if self.kv_connector else 2
while pp_group.is_first_rank: pass
assert not continues_previous_run
y = [m for m in ms if m.num_lookahead_slots]
if self.enable_chunked_prefill: pass
if self._make_room_for(seq_group, num_lookahead_slots): pass
if is_multi_step(config): pass
"""
    assert [line for line, _ in mode_branches(source)] == [2, 3, 4, 5, 6, 7, 10]


def test_the_plain_files_branch_on_few_modes():
    per_file = {path: mode_branches((PACKAGE / path).read_text()) for path in PLAIN_FILES}
    total = sum(len(found) for found in per_file.values())
    listing = "\n".join(f"  {path}:{line}: {text}" for path, found in per_file.items() for line, text in found)
    assert total <= MAX_MODE_BRANCHES, (
        f"{total} branches on mode settings in the plain path (at most {MAX_MODE_BRANCHES}); move them into "
        f"the mode's own file:\n{listing}")


def test_shared_types_carry_no_mode_only_field():
    for shared in (SamplerOutput, ExecuteModelRequest):
        names = {f.name for f in dataclasses.fields(shared)} | set(vars(shared))
        assert not names & MODE_ONLY_FIELDS, f"{shared.__name__} still has {sorted(names & MODE_ONLY_FIELDS)}"
    assert [f.name for f in dataclasses.fields(SamplerOutput)] == ["outputs"]
