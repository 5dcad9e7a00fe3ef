"""The worker side of a KV connector: loads and saves KV blocks inside the forward pass.

An optional mode in a file of its own, mixed over the plain runner (eager or CUDA graphs) by
`selector.py` (vLLM v1 puts the same calls in `KVConnectorModelRunnerMixin` and the
attention layer). One step:

    bind_connector_metadata(meta)       the step's loads and saves, with physical block ids
    start_load_kv()                     read the store, start copying into the cache
    (a failed load: recompute those blocks now, in an extra forward that samples nothing)
    forward:  for each attention layer  wait_for_layer_load(name)   <- a forward pre-hook
                                        attention (writes the new K/V into the cache)
                                        save_kv_layer(name, kv, md) <- a forward hook
    wait_for_save()                     the step's blocks are in the store
    clear_connector_metadata()

The hooks sit on the model's `Attention` modules, so the model file knows nothing of
connectors. A replayed CUDA graph runs no hooks, so a step that loads or saves runs eagerly;
the steps that move nothing (decodes: loads and saves happen in prefill steps) replay graphs
as usual when the engine captured them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from minivllm.attention import Attention
from minivllm.distributed import get_tp_group
from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorMetadata, KVConnectorRole, KVTransferStats
from minivllm.sequence import ExecuteModelRequest, SamplerOutput, SequenceData, SequenceGroupMetadata
from minivllm.worker.model_runner import ModelRunner


@dataclass
class KVTransferSamplerOutput(SamplerOutput):
    """A step's output with the connector's cumulative counts (`kv_transfer_stats`)."""

    kv_transfer_stats: KVTransferStats | None = None


class KVConnectorWorkerMixin:
    """Over a `Worker` (plain or multi-step): hands each step's connector metadata to the
    runner, which takes it in its next `execute_model`."""

    def execute_model(self, execute_model_req: ExecuteModelRequest):
        self.model_runner.bind_connector_metadata(execute_model_req.kv_connector_metadata)
        return super().execute_model(execute_model_req)


class KVConnectorModelRunnerMixin:
    """Over a `ModelRunner` (eager or `CUDAGraphModelRunner`): the engine's KV connector
    (`kv_connector`), its hooks on the attention layers, and a step that loads and saves."""

    def __init__(self, engine_config, device=None) -> None:
        super().__init__(engine_config, device)
        self.kv_connector = KVConnectorFactory.create_connector(engine_config, KVConnectorRole.WORKER)
        self._connector_metadata: KVConnectorMetadata | None = None
        self._hooks_load = self._hooks_save = False  # hooks act only inside a step that transfers
        self._transfers = False  # this step loads or saves: its forward passes run eagerly

    def load_model(self) -> None:
        super().load_model()
        self.attention_layers = [(name, m) for name, m in self.model.named_modules() if isinstance(m, Attention)]
        for name, module in self.attention_layers:
            module.register_forward_pre_hook(partial(self._before_attention, name))
            module.register_forward_hook(partial(self._after_attention, name))

    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """The cache exists now: give the connector each layer's cache, by layer name."""
        super().capture_model(kv_caches)
        self.kv_connector.register_kv_caches(
            {name: kv_cache for (name, _), kv_cache in zip(self.attention_layers, kv_caches)})

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata, kv_caches: list[torch.Tensor]):
        if self._transfers:  # the hooks must run: no graph replay (the eager forward of ModelRunner)
            return ModelRunner.run_model(self, input_ids, positions, attn_metadata, kv_caches)
        return super().run_model(input_ids, positions, attn_metadata, kv_caches)

    def _before_attention(self, layer_name: str, module, args) -> None:
        if self._hooks_load:
            self.kv_connector.wait_for_layer_load(layer_name)

    def _after_attention(self, layer_name: str, module, args, output) -> None:
        if self._hooks_save:
            _, _, _, kv_cache, attn_metadata = args
            self.kv_connector.save_kv_layer(layer_name, kv_cache, attn_metadata)

    # ------------------------------------------------------------------ a step
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata | None) -> None:
        """The worker hands over the step's metadata before `execute_model`."""
        self._connector_metadata = connector_metadata

    @torch.inference_mode()
    def execute_model(self, seq_group_metadata_list: list[SequenceGroupMetadata], kv_caches: list[torch.Tensor],
                      finished_requests_ids: list[str] | None = None) -> SamplerOutput:
        meta, self._connector_metadata = self._connector_metadata, None
        if meta is None or not seq_group_metadata_list:  # the profile run, an empty step
            return super().execute_model(seq_group_metadata_list, kv_caches, finished_requests_ids)
        tables = {m.request_id: next(iter(m.block_tables.values())) for m in seq_group_metadata_list}
        bound = meta.with_block_tables(tables)
        connector = self.kv_connector
        connector.bind_connector_metadata(bound)
        self._transfers = bool(bound.requests)
        try:
            connector.start_load_kv()
            self._hooks_load = True
            self._recompute_failed_loads(bound, seq_group_metadata_list, kv_caches)
            self._hooks_save = True
            output = super().execute_model(seq_group_metadata_list, kv_caches, finished_requests_ids)
            self._hooks_load = self._hooks_save = False
            connector.wait_for_save()
        finally:
            self._hooks_load = self._hooks_save = self._transfers = False
            connector.clear_connector_metadata()
        return KVTransferSamplerOutput(output.outputs, kv_transfer_stats=connector.stats.copy())

    def _recompute_failed_loads(self, bound: KVConnectorMetadata, seq_group_metadata_list: list[SequenceGroupMetadata],
                                kv_caches: list[torch.Tensor]) -> None:
        """Recompute the loaded region of every request with a failed block, so the step sees
        exactly the K/V the scheduler counted as computed. Tensor-parallel ranks agree first
        (one all-reduce): the extra forward is a collective, all run it or none."""
        failed_blocks = self.kv_connector.get_block_ids_with_load_errors()
        loading = [r for r in bound.requests if r.load]
        flags = torch.tensor([float(bool(failed_blocks & set(r.load_block_ids))) for r in loading])
        if get_tp_group().world_size > 1:  # (with a connector the world is one TP group: no stages)
            flags = get_tp_group().all_reduce(flags.to(self.device)).cpu()
        failed = {r.request_id: r.load[0][0] for r, flag in zip(loading, flags.tolist()) if flag > 0}
        if not failed:
            return
        # The recompute rewrites loaded blocks too (from the first loaded block on), and on the
        # Triton backend a fused kernel writes the cache BEFORE the attention module's load
        # wait: let every layer's load land first, so the recomputed K/V are the last writes.
        # (A normal step never overlaps: new tokens start in a block after the loaded ones.)
        for name, _ in self.attention_layers:
            self.kv_connector.wait_for_layer_load(name)
        redo = [self._recompute_metadata(m, failed[m.request_id]) for m in seq_group_metadata_list
                if m.request_id in failed]
        super().execute_model(redo, kv_caches)

    def _recompute_metadata(self, metadata: SequenceGroupMetadata, first_block: int) -> SequenceGroupMetadata:
        """A prefill of the tokens from block `first_block` up to where this step starts,
        which samples nothing (a copy: the scheduler's sequence data stays as it is)."""
        (seq_id, data), = metadata.seq_data.items()
        start = first_block * self.block_size
        redo = SequenceData(list(data.prompt_token_ids), list(data.output_token_ids), num_computed_tokens=start)
        return dataclasses.replace(metadata, is_prompt=True, seq_data={seq_id: redo},
                                   token_chunk_size=data.num_computed_tokens - start, do_sample=False)
