"""One pipeline stage's worker: `PipelineStageWorker`.

Mirrors the pipeline parts of `vllm/worker/worker_base.py` (v0's `execute_model`), in a file
of its own; the executor builds it on every rank when `pipeline_parallel_size` > 1, over a
`PipelineStageModelRunner`. A step on stage s:

    s > 0         receive the previous stage's IntermediateTensors
    forward       this stage's layers
    s < last      send its IntermediateTensors on; return no outputs
    s = last      return the step's `SamplerOutput` (the executor reads the output rank's)

Every stage skips an empty step (block moves only) alike, so no stage waits on a send that
never comes.
"""

from __future__ import annotations

from minivllm.distributed import get_pp_group
from minivllm.model_executor.models.utils import IntermediateTensors
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.worker import Worker


class PipelineStageWorker(Worker):
    """A `Worker` that receives its input from the previous stage and sends its output on."""

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> list[SamplerOutput]:
        self.apply_block_moves(execute_model_req)
        metadata_list = execute_model_req.seq_group_metadata_list
        pp_group = get_pp_group()
        previous = None
        if metadata_list and not pp_group.is_first_rank:
            previous = IntermediateTensors(pp_group.recv_tensor_dict(device=self.device))
        output = self.model_runner.execute_model(metadata_list, self.kv_caches, execute_model_req.finished_requests_ids,
                                                 previous)
        if isinstance(output, IntermediateTensors):  # a stage before the last: pass it on
            pp_group.send_tensor_dict(output.tensors)
            return []
        return [output]
