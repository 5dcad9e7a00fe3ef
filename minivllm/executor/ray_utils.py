"""The Ray side of the `ray` executor (vLLM's `vllm/executor/ray_utils.py`).

`RayWorkerWrapper` is the actor class: it builds a `Worker` once the rendezvous address is
known, and runs whatever `Worker` method the executor sends. `ray` is an optional
dependency (`pip install minivllm[ray]`): this module imports it only when asked.
"""

from __future__ import annotations

from typing import Any

from minivllm.config import EngineConfig
from minivllm.distributed.utils import get_open_port
from minivllm.executor.metadata_delta import MetadataDecoder


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'minivllm[ray]'.") from err
    return ray


class RayWorkerWrapper:
    """Lives in a Ray actor; holds one rank's `Worker`."""

    def __init__(self) -> None:
        self.worker = None
        self.decoder = MetadataDecoder()  # a step's requests arrive as deltas (metadata_delta.py)

    def get_node_ip(self) -> str:
        return import_ray().util.get_node_ip_address()

    def get_open_port(self) -> int:
        return get_open_port()

    def init_worker(self, engine_config: EngineConfig, local_rank: int, rank: int, distributed_init_method: str) -> None:
        from minivllm.worker.selector import worker_class

        cls = worker_class(engine_config)
        self.worker = cls(engine_config, local_rank=local_rank, rank=rank, distributed_init_method=distributed_init_method,
                          is_driver_worker=rank == 0)

    def execute_method(self, method, *args: Any) -> Any:
        return method(self.worker, *self.decoder.decode_args(args))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
