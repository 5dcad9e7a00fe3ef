"""KV transfer: the KV cache beyond one engine (vLLM's `vllm/distributed/kv_transfer`).

`base.py` holds the seven-method interface, `factory.py` the connectors by name, and one file
per connector: `shared_storage_connector.py` (files), `cpu_offload_connector.py` (host
memory), `redis_connector.py` (Redis). The engine builds the scheduler side
(`KVConnectorRole.SCHEDULER`), each worker its own worker side.
"""

from minivllm.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorRole,
                                                   KVTransferStats, ReqMeta)
from minivllm.distributed.kv_transfer.factory import KVConnectorFactory, register_connector

__all__ = ["KVConnectorBase", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorRole", "KVTransferStats",
           "ReqMeta", "register_connector"]
