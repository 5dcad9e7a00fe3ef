"""`TokenStatsCache`: the penalties' per-request token statistics kept on the device between
steps must always equal what counting the token lists from scratch gives (`token_counts`),
whatever order requests arrive in, grow, end and reuse pool rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.model_executor.sampling_metadata import SamplingTensors, SequenceGroupToSample
from minivllm.model_executor.token_stats import TokenStatsCache, token_counts
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


@pytest.mark.parametrize("num_rows", range(1, 10))
def test_every_sampling_tensor_starts_16_bytes_aligned(num_rows):
    """Triton specializes kernels on their pointers' 16-byte alignment: a field that starts
    unaligned for some batch sizes compiles the sampling kernels again mid-run."""
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.1,
                            frequency_penalty=0.2, presence_penalty=0.3, min_tokens=3)
    groups = [SequenceGroupToSample(request_id=str(i), seq_ids=[0], sampling_params=params,
                                    seq_data={0: SequenceData([1, 2, 3])}, is_prompt=False, do_sample=True,
                                    prompt_logprob_indices=[], prompt_logprob_token_ids=[], sample_indices=[i])
              for i in range(num_rows)]
    t = SamplingTensors.from_groups(groups, VOCAB, "cpu", TokenStatsCache(VOCAB, "cpu"))
    fields = {name: value for name, value in vars(t).items() if isinstance(value, torch.Tensor)}
    assert {"temperature", "top_p", "min_p", "top_k", "seeds", "offsets", "repetition_penalty"} <= fields.keys()
    assert {name: value.data_ptr() % 16 for name, value in fields.items()} == {name: 0 for name in fields}


def test_beam_search_gives_back_the_rows_of_beams_it_dropped():
    """Beam search replaces its beams by new sequences every step; the request's pool rows
    must follow the live beams, not pile up until the request ends."""
    cache = TokenStatsCache(VOCAB, "cpu")
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, repetition_penalty=1.3)
    for step in range(20):
        seq_ids = [2 * step, 2 * step + 1]  # this step's two beams, new sequences each step
        beams = SequenceGroupToSample(request_id="beam", seq_ids=seq_ids, sampling_params=params,
                                      seq_data={i: SequenceData([1, 2, 3], [4] * step) for i in seq_ids},
                                      is_prompt=False, do_sample=True, prompt_logprob_indices=[],
                                      prompt_logprob_token_ids=[], sample_indices=[0, 1])
        cache.rows([(beams, i) for i in seq_ids])
        cache.release_dropped_sequences("beam", set(seq_ids))
        assert sorted(key[1] for key in cache.slots) == seq_ids
    assert cache.prompt_mask.shape[0] <= 16  # the pool never grew past its first size
