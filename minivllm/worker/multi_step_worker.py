"""The worker of multi-step scheduling: `MultiStepWorker`.

Mirrors `vllm/worker/multi_step_worker.py`: a `Worker` whose decode batches may run several
steps per schedule through a `MultiStepModelRunner` wrapped around its plain runner. The
engine picks it (through the executor) when `num_scheduler_steps` > 1.
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.config import EngineConfig
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.multi_step_model_runner import MultiStepModelRunner
from minivllm.worker.worker import Worker


class MultiStepWorker(Worker):
    """Runs `num_steps` decode steps when the batch allows it, else one step as `Worker` does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.multi_step_runner = MultiStepModelRunner(self.model_runner)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        """One `SamplerOutput` per step run. A multi-step run queues all its steps on the device
        before it returns, then hands each step's output over as it reaches the host, so the
        caller processes one step while the device computes the next (and may schedule and
        queue the next run before the last output: `continues_previous_run`).

        Batches that need the host every token (beams, n > 1, logits processors, prefills,
        KV connector loads and saves) run one step.
        """
        req = execute_model_req
        moves_kv = bool(getattr(req.kv_connector_metadata, "requests", None))  # loads and saves: one step
        if req.num_steps == 1 or moves_kv or not self.multi_step_runner.can_run(req.seq_group_metadata_list):
            if req.continues_previous_run:
                raise RuntimeError("a batch that continues a multi-step run must itself run several steps.")
            return super().execute_model(req)
        self.apply_block_moves(req)
        return self.multi_step_runner.execute_model(req.seq_group_metadata_list, self.kv_caches, req.num_steps,
                                                    req.finished_requests_ids, req.continues_previous_run)

def worker_class(engine_config: EngineConfig) -> type[Worker]:
    """The class every rank's worker is built from (vLLM picks the same way: the multi-step
    worker only when multi-step scheduling is on)."""
    return MultiStepWorker if engine_config.scheduler_config.num_scheduler_steps > 1 else Worker
