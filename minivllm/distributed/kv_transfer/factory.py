"""Connectors by name: `register_connector(name, module, class)` (vLLM's `KVConnectorFactory`).

A third-party connector plugs in without touching minivllm: register it (a plugin's entry
point is a good place, see `minivllm.plugins`) and name it in `KVTransferConfig`:

    register_connector("MyConnector", "my_package.connector", "MyConnector")
    LLM(kv_transfer_config=KVTransferConfig(kv_connector="MyConnector", kv_role="kv_both"))

The module is imported only when an engine asks for the connector.
"""

from __future__ import annotations

import importlib
from typing import Any

from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole


class KVConnectorFactory:
    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Make `name` build `module_path.class_name` (a `KVConnectorBase` subclass)."""
        if name in cls._registry and cls._registry[name] != (module_path, class_name):
            raise ValueError(f"a KV connector named {name!r} is already registered "
                             f"({'.'.join(cls._registry[name])}).")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def get_connector_class(cls, name: str) -> type[KVConnectorBase]:
        if name not in cls._registry:
            raise ValueError(f"unknown KV connector {name!r}; registered: {sorted(cls._registry)} "
                             "(register_connector adds one).")
        module_path, class_name = cls._registry[name]
        connector_class = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(connector_class, type) and issubclass(connector_class, KVConnectorBase)):
            raise ValueError(f"KV connector {name!r} ({module_path}.{class_name}) is not a KVConnectorBase.")
        return connector_class

    @classmethod
    def create_connector(cls, engine_config: Any, role: KVConnectorRole) -> KVConnectorBase:
        """The connector `engine_config.kv_transfer_config` names, for one side."""
        name = engine_config.kv_transfer_config.kv_connector
        return cls.get_connector_class(name)(engine_config, role)


register_connector = KVConnectorFactory.register_connector

_PACKAGE = "minivllm.distributed.kv_transfer"
register_connector("SharedStorageConnector", f"{_PACKAGE}.shared_storage_connector", "SharedStorageConnector")
register_connector("CPUOffloadConnector", f"{_PACKAGE}.cpu_offload_connector", "CPUOffloadConnector")
register_connector("RedisConnector", f"{_PACKAGE}.redis_connector", "RedisConnector")
