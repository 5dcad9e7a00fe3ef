"""`RedisConnector`: KV blocks in Redis, the shape of a store shared across machines.

The same keys and framing as the file store (`store_connector`), one Redis string per block
under `minivllm:kv:<key>`. Capacity and eviction are Redis's own: run the server with
`maxmemory` and `maxmemory-policy allkeys-lru` (optional `ttl_s` in the extra config gives each
block an expiry). A Redis that goes away mid-run costs recomputation, never a request: every
call has a short timeout, and after a failure the store is skipped for `retry_interval_s`.

    KVTransferConfig(kv_connector="RedisConnector", kv_role="kv_both",
                     kv_connector_extra_config={"url": "redis://localhost:6379/0"})

Needs redis-py (`pip install minivllm[kv]`).
"""

from __future__ import annotations

from minivllm.distributed.kv_transfer.store_connector import KVStore, StoreConnector

_KEY_PREFIX = "minivllm:kv:"
_DEFAULT_TIMEOUT_S = 1.0


class RedisKVStore(KVStore):
    def __init__(self, url: str, timeout_s: float = _DEFAULT_TIMEOUT_S, ttl_s: float | None = None) -> None:
        import redis  # deferred: an optional dependency

        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self.errors = (redis.exceptions.RedisError, OSError)

    def exists(self, keys: list[str]) -> bool:
        return self.client.exists(*[_KEY_PREFIX + key for key in keys]) == len(keys)

    def get(self, key: str, max_bytes: int) -> bytes | None:
        data = self.client.getrange(_KEY_PREFIX + key, 0, max_bytes)  # at most max_bytes + 1 bytes
        return data if 0 < len(data) <= max_bytes else None  # b"": no such key

    def put_many(self, items: list[tuple[str, bytes]]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key, data in items:
            pipe.set(_KEY_PREFIX + key, data, ex=None if self.ttl_s is None else int(self.ttl_s))
        pipe.execute()  # raises if any write failed
        return len(items)


class RedisConnector(StoreConnector):
    """Extra config: `url` (default redis://localhost:6379/0), `timeout_s`, `ttl_s`,
    `retry_interval_s`."""

    def make_store(self) -> RedisKVStore:
        ttl = self.extra_config.get("ttl_s")
        return RedisKVStore(self.extra_config.get("url", "redis://localhost:6379/0"),
                            float(self.extra_config.get("timeout_s", _DEFAULT_TIMEOUT_S)),
                            None if ttl is None else float(ttl))
