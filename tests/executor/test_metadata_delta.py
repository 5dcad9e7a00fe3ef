"""The mp executor's request deltas: what a worker rebuilds is exactly what the engine sent,
whatever happens to the requests between steps; and a decode step travels small."""

from __future__ import annotations

import copy
import dataclasses
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.executor.metadata_delta import MetadataDecoder, MetadataEncoder, SequenceGroupMetadataDelta
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata


def _group(request_id: str, seq_data: dict[int, SequenceData], is_prompt: bool) -> SequenceGroupMetadata:
    block_tables = {seq_id: list(range(data.get_len() // 16 + 1)) for seq_id, data in seq_data.items()}
    chunk = seq_data[min(seq_data)].get_len() if is_prompt else 1
    return SequenceGroupMetadata(request_id, is_prompt, seq_data, SamplingParams(temperature=0.6), block_tables, chunk)


def _send(encoder: MetadataEncoder, decoder: MetadataDecoder, request: ExecuteModelRequest) -> ExecuteModelRequest:
    """Through a pickle, as the queue does: the worker side shares no object with the engine's."""
    sent = copy.deepcopy(request)  # the engine keeps mutating its own sequences afterwards
    return decoder.decode(pickle.loads(pickle.dumps(encoder.encode(sent))))


def test_a_decode_step_travels_as_a_delta_of_its_new_token():
    encoder, decoder = MetadataEncoder(), MetadataDecoder()
    data = SequenceData(list(range(1000)))
    _send(encoder, decoder, ExecuteModelRequest([_group("r", {0: data}, is_prompt=True)]))
    data.append_token_id(7, -0.5)
    data.num_computed_tokens = 1000
    step = ExecuteModelRequest([_group("r", {0: data}, is_prompt=False)])
    encoded = encoder.encode(copy.deepcopy(step))
    [delta] = encoded.seq_group_metadata_list
    assert isinstance(delta, SequenceGroupMetadataDelta)
    assert delta.seq_data_delta[0].new_output_token_ids == [7]
    assert len(pickle.dumps(encoded)) * 5 < len(pickle.dumps(step))  # the prompt stays behind
    assert decoder.decode(encoded) == step


# One step of a random history: live requests decode (one token per sequence, or several as in
# a multi-step run), one may be left out of the step (swapped out, not scheduled), be preempted
# by recompute (sent again as a prompt), fork a sequence, lose one (a finished sibling), finish,
# or a new one arrives. The per-step fields vary too, so a decoder that kept stale ones fails.
ACTIONS = st.lists(st.sampled_from(["decode", "decode", "multi", "skip", "recompute", "fork", "drop", "finish",
                                    "arrive"]), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(actions=ACTIONS, data=st.data())
def test_the_worker_rebuilds_exactly_the_engines_metadata(actions, data):
    encoder, decoder = MetadataEncoder(), MetadataDecoder()
    live: dict[str, dict[int, SequenceData]] = {}
    next_id = 0
    for step, action in enumerate(actions):
        finished, prompts, skipped = [], set(), set()
        target = data.draw(st.sampled_from(sorted(live))) if live else None
        if action == "arrive" or target is None:
            live[str(next_id)] = {next_id: SequenceData(list(range(data.draw(st.integers(1, 50)))))}
            prompts.add(str(next_id))
            next_id += 1
        elif action == "finish":
            del live[target]
            finished.append(target)
        elif action == "skip":
            skipped.add(target)
        elif action == "recompute":
            for seq_data in live[target].values():
                seq_data.num_computed_tokens = 0
            prompts.add(target)
        elif action == "fork":
            parent = next(iter(live[target].values()))
            live[target][1000 + next_id] = SequenceData(list(parent.prompt_token_ids), list(parent.output_token_ids))
            next_id += 1
        elif action == "drop" and len(live[target]) > 1:
            del live[target][max(live[target])]
        new_tokens = data.draw(st.integers(2, 8)) if action == "multi" else 1
        for request_id, seqs in live.items():
            if request_id in prompts:
                continue
            for seq_id, seq_data in seqs.items():  # a skipped request may still have moved on
                for k in range(new_tokens):
                    seq_data.append_token_id(seq_id + step + k, -1.0)
                seq_data.num_computed_tokens = seq_data.get_len() - 1
        groups = []
        for request_id, seqs in live.items():
            if request_id in skipped:
                continue
            group = _group(request_id, seqs, request_id in prompts)
            groups.append(dataclasses.replace(group, do_sample=data.draw(st.booleans()),
                                              num_lookahead_slots=data.draw(st.integers(0, 7))))
        request = ExecuteModelRequest(groups, finished_requests_ids=finished)
        assert _send(encoder, decoder, request) == request
