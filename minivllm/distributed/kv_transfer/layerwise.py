"""Moving blocks between a worker's paged cache and host memory, one layer at a time.

The connectors' worker side shares this: loads are issued for every layer before the forward
pass and waited for layer by layer (`wait_layer`, just before that layer's attention); saves
gather one layer's blocks right after its attention wrote them (`save_layer`). On a GPU the
copies run on a side stream, so layer l+1's load and layer l-1's save overlap layer l's
compute; on a CPU they are plain copies.

Host layout, layer-major so that one layer's blocks are one contiguous slice:
    blocks [num_layers, n, 2, block_size, num_kv_heads, head_dim]
while each layer's cache is [2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from typing import Any

import torch


class LayerwiseTransfer:
    """One worker's per-layer block copies. `kv_caches`: layer name -> its paged cache, in
    the order the forward pass runs the layers."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        self.device, self.dtype = first.device, first.dtype
        self.num_layers = len(kv_caches)
        # One block of every layer: [num_layers, 2, block_size, num_kv_heads, head_dim].
        self.block_shape = (self.num_layers, 2, *first.shape[2:])
        self.block_nbytes = first[:, 0].numel() * first.element_size() * self.num_layers
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._load_events: dict[str, torch.cuda.Event] = {}
        self._load_host: torch.Tensor | None = None  # kept alive until the copies finish
        self._save_ids: torch.Tensor | None = None
        self._save_buffer: torch.Tensor | None = None

    def host_empty(self, num_blocks: int) -> torch.Tensor:
        """Host memory for `num_blocks` blocks (pinned on a GPU machine: DMA, asynchronous)."""
        shape = (self.num_layers, num_blocks, *self.block_shape[1:])
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.stream is not None)

    # ------------------------------------------------------------------ loads
    def start_load(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy `blocks` [num_layers, n, ...] (host) into the cache's `block_ids`."""
        self._load_events.clear()
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.stream is None:
            for layer, kv_cache in enumerate(self.kv_caches.values()):
                kv_cache[:, ids] = blocks[layer].transpose(0, 1)
            return
        self._load_host = blocks if blocks.is_pinned() else blocks.pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for layer, (name, kv_cache) in enumerate(self.kv_caches.items()):
                on_device = self._load_host[layer].to(self.device, non_blocking=True)
                kv_cache[:, ids] = on_device.transpose(0, 1)
                event = torch.cuda.Event()
                event.record(self.stream)
                self._load_events[name] = event

    def wait_layer(self, layer_name: str) -> None:
        """Make the compute stream wait for this layer's loads (a no-op on a CPU)."""
        event = self._load_events.pop(layer_name, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ------------------------------------------------------------------ saves
    def start_save(self, block_ids: list[int]) -> None:
        """This step will save `block_ids`: room for them, filled layer by layer."""
        if not block_ids:
            self._save_ids = self._save_buffer = None
            return
        self._save_ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self._save_buffer = self.host_empty(len(block_ids))

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self._save_ids is None:
            return
        target = self._save_buffer[self.layer_index[layer_name]]
        if self.stream is None:
            target.copy_(kv_layer[:, self._save_ids].transpose(0, 1))
            return
        # After this layer's attention (on the compute stream) wrote the blocks.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            target.copy_(kv_layer[:, self._save_ids].transpose(0, 1), non_blocking=True)

    def finish_save(self) -> torch.Tensor | None:
        """The saved blocks [num_layers, n, ...] on the host, once every copy is done."""
        if self.stream is not None:
            self.stream.synchronize()
            self._load_host = None
        buffer, self._save_ids, self._save_buffer = self._save_buffer, None, None
        return buffer


class LayerwiseConnectorMixin:
    """The worker side every connector that moves whole layers through `self.transfer` (a
    `LayerwiseTransfer`) shares: wait for a layer's load, save a layer, count what moved.
    Put it before `KVConnectorBase` in the bases, so these override the base's no-ops."""

    transfer: LayerwiseTransfer

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.transfer.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.transfer.save_layer(layer_name, kv_layer)

    def _count_loaded(self, num_blocks: int) -> None:
        self.stats.num_tokens_loaded += num_blocks * self.block_size
        self.stats.bytes_loaded += num_blocks * self.transfer.block_nbytes

    def _count_saved(self, num_blocks: int) -> None:
        self.stats.num_tokens_saved += num_blocks * self.block_size
        self.stats.bytes_saved += num_blocks * self.transfer.block_nbytes
