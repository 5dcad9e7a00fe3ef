"""The scheduler's one KV-connector extension point, and its null default.

The scheduler side of a connector (`minivllm.distributed.kv_transfer.KVConnectorBase`, vLLM
v1's `KVConnectorBase_V1`) is asked four things; the scheduler calls them on every engine, and
without a connector it holds `NoKVConnector`, which answers "nothing outside":

    get_num_new_matched_tokens(seq_group, num_local)  at admission: (tokens the store holds
                                                      after the local prefix hits, load async?)
    update_state_after_alloc(seq_group, block_ids, n) the admitted group's blocks; n load now
    build_connector_meta(scheduler_outputs)           this step's loads and saves (None: none)
    request_finished(seq_group, block_ids)            before the finished group's blocks are freed
"""

from __future__ import annotations

from typing import Any


class NoKVConnector:
    """No outside store: no tokens matched, nothing to load or save."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_outputs: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None
