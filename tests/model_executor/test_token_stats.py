"""`TokenStatsCache`: the penalties' per-request token statistics kept on the device between
steps must always equal what counting the token lists from scratch gives (`token_counts`),
whatever order requests arrive in, grow, end and reuse pool rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.model_executor.sampling_metadata import SequenceGroupToSample, TokenStatsCache, token_counts
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceData

VOCAB = 11


def group(request_id: str, data: SequenceData) -> SequenceGroupToSample:
    return SequenceGroupToSample(request_id=request_id, seq_ids=[0], sampling_params=SamplingParams(),
                                 seq_data={0: data}, is_prompt=False, do_sample=True, prompt_logprob_indices=[],
                                 prompt_logprob_token_ids=[], sample_indices=[0])


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=6)
# Each operation: a new request (its prompt), tokens appended to a live request, a request
# ending, or a step that reads the statistics of every live request.
operations = st.lists(st.one_of(
    st.tuples(st.just("new"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
    st.tuples(st.just("append"), st.integers(0, 50), tokens),
    st.tuples(st.just("end"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.just(None)),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_cached_statistics_equal_a_count_from_scratch(ops):
    cache = TokenStatsCache(VOCAB, "cpu")
    live: dict[str, SequenceData] = {}
    next_id = 0
    for op, arg, *rest in ops:
        if op == "new":
            live[str(next_id)] = SequenceData(list(arg))
            next_id += 1
        elif op == "append" and live:
            data = live[sorted(live)[arg % len(live)]]
            for token in rest[0]:
                data.append_token_id(token, 0.0)
        elif op == "end" and live:
            request_id = sorted(live)[arg % len(live)]
            del live[request_id]
            cache.release([request_id])
        elif op == "step" and live:
            ids = sorted(live)
            prompt_mask, counts = cache.rows([(group(i, live[i]), 0) for i in ids])
            datas = [live[i] for i in ids]
            assert torch.equal(prompt_mask, token_counts([d.prompt_token_ids for d in datas], VOCAB, "cpu") > 0)
            assert torch.equal(counts, token_counts([d.output_token_ids for d in datas], VOCAB, "cpu"))
            counts += 1  # the rows handed out are copies: changing them leaves the pool alone
    assert len(cache.slots) + len(cache.free_slots) == cache.output_counts.shape[0]
