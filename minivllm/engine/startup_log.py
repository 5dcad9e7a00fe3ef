"""Where an engine's start-up time goes: `StartupTimer`, one INFO line per engine (the bundled model on a CPU):

    start-up 0.60 s: tokenizer 0.03 s, workers and weights 0.03 s, profile run 0.00 s, KV cache and graphs 0.52 s

The phases are `LLMEngine.__init__`'s own calls, in order: the tokenizer; the executor
(its workers, their devices and the weights); `determine_num_available_blocks` (the
profile run); `initialize_cache` (the KV cache pools, then CUDA graph capture on a GPU,
which `cuda_graph_runner.py` times on its own line). Triton compiles a kernel at its
first launch, inside whichever phase launches it: with an empty kernel cache the profile
run and the graph capture grow by the compile time (`benchmarks/startup.py` measures both).
Before the engine exists, `ModelConfig` logs reading the checkpoint's config.json, with the
imports it makes (most of the time `LLM()` spends before this timer starts), on a line of its own:

    model config: llama from config.json in 1.04 s (268 modules imported)
"""

from __future__ import annotations

import logging
import time


class StartupTimer:
    """Wall time of consecutive phases: `lap(name)` ends the phase running since the last lap."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}  # phase -> seconds, in the order they ran

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def log(self, logger: logging.Logger) -> None:
        """One INFO line: the total since construction, then each phase."""
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        logger.info("start-up %.2f s: %s", time.perf_counter() - self.start, phases)
