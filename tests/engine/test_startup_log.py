"""The engine's start-up line: one INFO line per engine, naming its phases in order with their seconds."""

import logging
import re

import pytest
import torch

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.startup_log import StartupTimer

PHASES = ["tokenizer", "workers and weights", "profile run", "KV cache and graphs"]
LINE = re.compile(r"start-up (\d+\.\d+) s: (.*)")
GRAPHS = re.compile(r"captured CUDA graphs for (\d+) decode batch sizes (\[.*\]) and (\d+) prefill token counts "
                    r"(\[.*\]) in (\d+\.\d+) s")


def logged_phases(caplog) -> tuple[float, dict[str, float]]:
    """The one start-up line's total and its phases, in order."""
    lines = [r.getMessage() for r in caplog.records if r.name == "minivllm.engine.llm_engine"
             and r.getMessage().startswith("start-up ")]
    assert len(lines) == 1, lines
    total, listed = LINE.fullmatch(lines[0]).groups()
    phases = [re.fullmatch(r"(.+) (\d+\.\d+) s", part).groups() for part in listed.split(", ")]
    return float(total), {name: float(seconds) for name, seconds in phases}


def test_a_cpu_engine_logs_its_start_up_phases(checkpoint_dirs, caplog):
    path, _ = checkpoint_dirs["llama"]
    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=8, max_model_len=64))
    total, phases = logged_phases(caplog)
    assert list(phases) == PHASES
    assert all(s >= 0 for s in phases.values())
    assert sum(phases.values()) <= total + 0.01 * len(phases)  # each printed to 0.01 s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_engine_logs_its_graph_capture_inside_the_cache_phase(caplog):
    from minivllm import LLM

    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLM(device="cuda", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.4)
    _, phases = logged_phases(caplog)
    captures = [GRAPHS.fullmatch(r.getMessage()) for r in caplog.records if r.getMessage().startswith("captured")]
    assert len(captures) == 1 and captures[0].group(1, 2) == ("4", "[1, 2, 4, 8]")
    assert captures[0].group(3, 4) == ("4", "[512, 1024, 1536, 2048]")
    assert 0 <= float(captures[0].group(5)) <= phases["KV cache and graphs"] + 0.01


def test_laps_split_the_time_into_consecutive_phases(monkeypatch, caplog):
    clock = iter([10.0, 10.5, 12.0, 12.25])
    monkeypatch.setattr("minivllm.engine.startup_log.time.perf_counter", lambda: next(clock))
    timer = StartupTimer()
    timer.lap("a")
    timer.lap("b")
    logger = logging.getLogger("minivllm.test_startup")
    with caplog.at_level(logging.INFO, logger="minivllm.test_startup"):
        timer.log(logger)
    assert timer.phases == {"a": 0.5, "b": 1.5}
    assert caplog.records[-1].getMessage() == "start-up 2.25 s: a 0.50 s, b 1.50 s"
