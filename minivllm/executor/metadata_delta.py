"""Send a request's metadata to a worker process once, then only what changed.

vLLM 0.6 calls the message `SequenceGroupMetadataDelta` (in `vllm/sequence.py`; its SPMD
workers keep a cache and apply it). Here the executors encode on their side of each call to a
worker in another process (the `mp` executor's queues, the `ray` executor's actor calls) and
the worker decodes on the other, so the engine, the scheduler and the in-process driver
worker still see whole `SequenceGroupMetadata`.

Why: in full, every decode step carries every prompt and every token generated so far, to
pickle and unpickle per worker while the GPUs wait. A decode step appends one token per
sequence, so after its first step a request travels as its new tokens, block tables and
counters.

    engine process                          worker process
    MetadataEncoder.encode(request)  --->   MetadataDecoder.decode(request)
    remembers, per request and sequence,    keeps each request's last whole metadata;
    how many output tokens it sent          a delta extends it in place

A prefill (also a recompute after preemption) or a group whose sequences changed (a fork)
is sent whole, which resets both sides. `finished_requests_ids` clears both caches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minivllm.sequence import ExecuteModelRequest, SequenceGroupMetadata


@dataclass
class SequenceDataDelta:
    """What one sequence gained since the worker last saw it."""

    new_output_token_ids: list[int]
    new_cumulative_logprob: float
    new_num_computed_tokens: int


@dataclass
class SequenceGroupMetadataDelta:
    """A decode step's `SequenceGroupMetadata` without what the worker already holds (the
    prompt, earlier tokens, the sampling parameters, the adapter)."""

    request_id: str
    seq_data_delta: dict[int, SequenceDataDelta]
    block_tables: dict[int, list[int]]
    token_chunk_size: int
    do_sample: bool
    num_lookahead_slots: int


class MetadataEncoder:
    """The sending side: one per executor (every worker receives the same calls, so their
    copies of each request are alike)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, int]] = {}  # request id -> seq id -> output tokens sent

    def encode_args(self, args: tuple) -> tuple:
        """A call's arguments, each `ExecuteModelRequest` among them encoded."""
        return tuple(self.encode(a) if isinstance(a, ExecuteModelRequest) else a for a in args)

    def encode(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        for request_id in request.finished_requests_ids:
            self._sent.pop(request_id, None)
        encoded = [self._encode_group(metadata) for metadata in request.seq_group_metadata_list]
        return dataclasses.replace(request, seq_group_metadata_list=encoded)

    def _encode_group(self, metadata: SequenceGroupMetadata) -> SequenceGroupMetadata | SequenceGroupMetadataDelta:
        sent = self._sent.get(metadata.request_id)
        lengths = {seq_id: data.get_output_len() for seq_id, data in metadata.seq_data.items()}
        self._sent[metadata.request_id] = lengths
        if _must_send_whole(metadata, sent, lengths):
            return metadata
        deltas = {seq_id: SequenceDataDelta(data.output_token_ids[sent[seq_id]:], data.cumulative_logprob,
                                            data.num_computed_tokens)
                  for seq_id, data in metadata.seq_data.items()}
        return SequenceGroupMetadataDelta(metadata.request_id, deltas, metadata.block_tables,
                                          metadata.token_chunk_size, metadata.do_sample, metadata.num_lookahead_slots)


def _must_send_whole(metadata: SequenceGroupMetadata, sent: dict[int, int] | None, lengths: dict[int, int]) -> bool:
    return (metadata.is_prompt  # a prefill, or a recompute after preemption: the worker's copy is stale
            or sent is None  # the worker has never seen this request
            or sent.keys() != lengths.keys()  # sequences forked or left: the group changed shape
            or any(lengths[s] < sent[s] for s in lengths))  # tokens taken back: a delta only appends


class MetadataDecoder:
    """The receiving side, in the worker process: rebuilds whole metadata from deltas."""

    def __init__(self) -> None:
        self._groups: dict[str, SequenceGroupMetadata] = {}

    def decode_args(self, args: tuple) -> tuple:
        """A call's arguments, each encoded `ExecuteModelRequest` among them rebuilt."""
        return tuple(self.decode(a) if isinstance(a, ExecuteModelRequest) else a for a in args)

    def decode(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        for request_id in request.finished_requests_ids:
            self._groups.pop(request_id, None)
        decoded = []
        for item in request.seq_group_metadata_list:
            metadata = self._apply(item) if isinstance(item, SequenceGroupMetadataDelta) else item
            self._groups[metadata.request_id] = metadata
            decoded.append(metadata)
        return dataclasses.replace(request, seq_group_metadata_list=decoded)

    def _apply(self, delta: SequenceGroupMetadataDelta) -> SequenceGroupMetadata:
        cached = self._groups[delta.request_id]
        for seq_id, change in delta.seq_data_delta.items():
            data = cached.seq_data[seq_id]
            data.output_token_ids.extend(change.new_output_token_ids)
            data.cumulative_logprob = change.new_cumulative_logprob
            data.num_computed_tokens = change.new_num_computed_tokens
        return dataclasses.replace(cached, is_prompt=False, block_tables=delta.block_tables,
                                   token_chunk_size=delta.token_chunk_size, do_sample=delta.do_sample,
                                   num_lookahead_slots=delta.num_lookahead_slots)
