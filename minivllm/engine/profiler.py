"""torch.profiler on every worker: vLLM's `start_profile` / `stop_profile` for `LLMEngine` and `LLM`.

The traces go to the folder named by MINIVLLM_TORCH_PROFILER_DIR (vLLM:
VLLM_TORCH_PROFILER_DIR), read in the engine's process; each worker writes one Chrome trace.
"""

from __future__ import annotations

import os

TORCH_PROFILER_DIR_ENV = "MINIVLLM_TORCH_PROFILER_DIR"


class EngineProfilerMixin:
    """`LLMEngine`'s profiling calls, passed on to its executor (`self.model_executor`)."""

    def start_profile(self) -> None:
        """Profile every worker until `stop_profile`; RuntimeError if no trace folder is set."""
        trace_dir = os.environ.get(TORCH_PROFILER_DIR_ENV)
        if not trace_dir:
            raise RuntimeError(f"profiling is off: set {TORCH_PROFILER_DIR_ENV} to a folder for the traces.")
        self.model_executor.start_profile(trace_dir)

    def stop_profile(self) -> list[str]:
        """Every worker's Chrome trace of the steps since `start_profile`: the paths, by rank."""
        return self.model_executor.stop_profile()


class LLMProfilerMixin:
    """`LLM.start_profile` / `stop_profile`: its engine's (`self.llm_engine`)."""

    def start_profile(self) -> None:
        self.llm_engine.start_profile()

    def stop_profile(self) -> list[str]:
        """The workers' Chrome traces (one per rank) of the calls since `start_profile`."""
        return self.llm_engine.stop_profile()
