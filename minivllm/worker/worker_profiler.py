"""`start_profile` / `stop_profile` of a worker: a torch.profiler trace of one rank (vLLM v0's
`Worker.start_profile` / `stop_profile`, with the traces written by `stop_profile`)."""

from __future__ import annotations

import os

import torch


class WorkerProfilerMixin:
    """Records this rank's CPU ops and GPU kernels between `start_profile` and `stop_profile`.

    Needs the worker's `device` and `rank`.
    """

    profiler: torch.profiler.profile | None = None
    trace_dir: str = ""
    num_traces: int = 0

    def start_profile(self, trace_dir: str) -> None:
        """Record until `stop_profile`, which writes the trace into `trace_dir`."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler, self.trace_dir = torch.profiler.profile(activities=activities), trace_dir
        self.profiler.start()

    def stop_profile(self) -> str:
        """Stop recording and write the Chrome trace (Perfetto or chrome://tracing opens it):
        its path, `<trace_dir>/rank<rank>-<n>.pt.trace.json`."""
        if self.profiler is None:
            raise RuntimeError("stop_profile without start_profile.")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels queued inside the window finish in it
        self.profiler.stop()
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"rank{self.rank}-{self.num_traces}.pt.trace.json")
        self.profiler.export_chrome_trace(path)
        self.profiler, self.num_traces = None, self.num_traces + 1
        return path
