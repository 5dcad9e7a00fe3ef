"""The worker of multi-step scheduling: `MultiStepWorker`.

Mirrors `vllm/worker/multi_step_worker.py`: a `Worker` whose decode batches may run several
steps per schedule through a `MultiStepModelRunner` wrapped around its plain runner. The
executor builds it when `num_scheduler_steps` > 1 (`selector.worker_class`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.multi_step_model_runner import MultiStepModelRunner
from minivllm.worker.worker import Worker


@dataclass
class ContinuedRunRequest(ExecuteModelRequest):
    """A multi-step run scheduled while the previous run's last step was still on the device
    (async scheduling): each sequence's first input is that step's token, taken on the device.
    Its sequences all ran in the previous run."""


class MultiStepWorker(Worker):
    """Runs `num_steps` decode steps when the batch allows it, else one step as `Worker` does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.multi_step_runner = MultiStepModelRunner(self.model_runner)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        """One `SamplerOutput` per step run. A multi-step run queues all its steps on the device
        before it returns, then hands each step's output over as it reaches the host, so the
        caller processes one step while the device computes the next (and may schedule and
        queue the next run before the last output: a `ContinuedRunRequest`).

        Batches that need the host every token (beams, n > 1, logits processors, prefills,
        KV connector loads and saves) run one step.
        """
        req = execute_model_req
        continues = isinstance(req, ContinuedRunRequest)
        moves_kv = bool(getattr(req.kv_connector_metadata, "requests", None))  # loads and saves: one step
        if req.num_steps == 1 or moves_kv or not self.multi_step_runner.can_run(req.seq_group_metadata_list):
            if continues:
                raise RuntimeError("a batch that continues a multi-step run must itself run several steps.")
            return super().execute_model(req)
        self.apply_block_moves(req)
        return self.multi_step_runner.execute_model(req.seq_group_metadata_list, self.kv_caches, req.num_steps,
                                                    req.finished_requests_ids, continues)
