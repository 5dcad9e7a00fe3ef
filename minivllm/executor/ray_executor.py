"""The `ray` executor: every rank a Ray actor, placed by a placement group.

Mirrors `vllm/executor/ray_gpu_executor.py`. What Ray adds over `mp`: it places workers on
the machines of a cluster. On several machines, start Ray first, as vLLM documents:

    ray start --head                         # on one machine
    ray start --address=<head-ip>:6379       # on each of the others
    minivllm generate ... -tp 8 -pp 2 --distributed-executor-backend ray

The executor joins the running cluster (`ray.init(address="auto")`), or starts a local Ray
instance when there is none. It reserves one bundle per rank in a placement group ({"GPU":
1} per rank on GPUs, {"CPU": 1} on CPUs; `PACK` puts them on as few machines as possible,
so a TP group shares a machine where it fits), starts one actor per bundle, and points
them all at rank 0's address for the torch.distributed rendezvous.

Differs from vLLM: rank 0 is an actor too (vLLM keeps a driver worker in the engine's
process), so the engine process holds no model; and no Ray compiled graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from minivllm.distributed.utils import get_distributed_init_method
from minivllm.executor.distributed_executor import DistributedExecutorBase, WorkerDiedError
from minivllm.executor.metadata_delta import MetadataEncoder
from minivllm.executor.ray_utils import RayWorkerWrapper, import_ray

logger = logging.getLogger(__name__)

# How long to wait for the cluster to grant the placement group, in seconds.
PLACEMENT_TIMEOUT_S = 60
# How long a health check waits for an actor's answer, in seconds.
_PING_TIMEOUT_S = 10


class RayDistributedExecutor(DistributedExecutorBase):
    """One Ray actor per rank; every call goes to all of them."""

    def _init_executor(self) -> None:
        ray = import_ray()
        self.ray = ray
        if not ray.is_initialized():
            self._init_ray(ray)
        world_size = self.engine_config.parallel_config.world_size
        on_gpu = self.engine_config.device_config.device_type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        self.placement_group = ray.util.placement_group([bundle] * world_size, strategy="PACK")
        self.workers: list = []
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as err:
            self.shutdown()
            raise ValueError(f"Ray could not reserve {world_size} bundle(s) of {bundle} within "
                             f"{PLACEMENT_TIMEOUT_S} s (cluster resources: {ray.cluster_resources()}).") from err
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(num_cpus=1, num_gpus=1 if on_gpu else 0)(RayWorkerWrapper)
        self.workers = [
            actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)).remote()
            for rank in range(world_size)]
        self.encoder = MetadataEncoder()  # the actors' copy of every request, sent as deltas
        try:
            ip, port = self._get([self.workers[0].get_node_ip.remote(), self.workers[0].get_open_port.remote()])
            init_method = get_distributed_init_method(ip, port)
            # Ray gives each GPU actor one visible GPU: inside it, that GPU is cuda:0.
            self._get([w.init_worker.remote(self.engine_config, 0, rank, init_method)
                       for rank, w in enumerate(self.workers)])
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _init_ray(ray) -> None:
        try:
            ray.init(address="auto", logging_level=logging.WARNING)  # a running cluster
        except ConnectionError:
            logger.info("no Ray cluster running: starting a local Ray instance")
            ray.init(logging_level=logging.WARNING)

    def _get(self, refs: list) -> list:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as err:
            raise WorkerDiedError(f"a Ray worker actor died; the engine cannot continue without it: {err}") from err
        except self.ray.exceptions.RayTaskError as err:
            # A live rank's collective fails when its peer dies ("connection closed by
            # peer"): report the dead actor, the cause, if there is one.
            self.check_health()
            raise err

    def check_health(self) -> None:
        for rank, worker in enumerate(self.workers):
            try:
                self.ray.get(worker.get_node_ip.remote(), timeout=_PING_TIMEOUT_S)
            except self.ray.exceptions.RayActorError as err:
                raise WorkerDiedError(f"Ray worker actor of rank {rank} died; the engine cannot continue "
                                      f"without it: {err}") from err

    def _run_workers(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        args = self.encoder.encode_args(args)  # once: every actor receives the same calls
        return self._get([worker.execute_method.remote(method, *args) for worker in self.workers])

    def shutdown(self) -> None:
        """Kill the actors and free the placement group (a cluster we joined stays up)."""
        for worker in getattr(self, "workers", []):
            try:
                self.ray.get(worker.shutdown.remote(), timeout=10)
            except Exception:  # already dead: nothing to release
                pass
            self.ray.kill(worker)
        self.workers = []
        if getattr(self, "placement_group", None) is not None:
            self.ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
