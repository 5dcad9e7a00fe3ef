"""`Sequence`, `SequenceData`, `SequenceGroup`: token accounting and vLLM v0's life cycle."""

from __future__ import annotations

import math

import pytest

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStage, SequenceStatus


def make_seq(seq_id: int = 0, prompt=(1, 2, 3), block_size: int = 4) -> Sequence:
    return Sequence(seq_id, "hi", list(prompt), block_size)


# ------------------------------------------------------------------ status
def test_finished_statuses_are_those_after_swapped():
    finished = {s for s in SequenceStatus if SequenceStatus.is_finished(s)}
    assert finished == {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH_CAPPED,
                        SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_IGNORED}


@pytest.mark.parametrize("status, reason", [
    (SequenceStatus.FINISHED_STOPPED, "stop"), (SequenceStatus.FINISHED_LENGTH_CAPPED, "length"),
    (SequenceStatus.FINISHED_ABORTED, "abort"), (SequenceStatus.FINISHED_IGNORED, "abort"),
    (SequenceStatus.RUNNING, None), (SequenceStatus.WAITING, None)])
def test_finish_reasons_follow_openai_names(status, reason):
    assert SequenceStatus.get_finished_reason(status) == reason


# ---------------------------------------------------------- token accounting
def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        Sequence(0, None, [], 4)


def test_lengths_and_token_views():
    seq = make_seq(prompt=[5, 6, 7])
    seq.append_token_id(8, {8: -0.5, 9: -1.5})
    seq.append_token_id(9, {9: -0.25})
    assert seq.get_token_ids() == [5, 6, 7, 8, 9]
    assert (seq.get_len(), seq.get_prompt_len(), seq.get_output_len()) == (5, 3, 2)
    assert seq.get_last_token_id() == 9 and seq.get_output_token_ids() == [8, 9]
    assert seq.get_cumulative_logprob() == pytest.approx(-0.75)
    assert seq.output_logprobs == [{8: -0.5, 9: -1.5}, {9: -0.25}]


def test_appending_does_not_alias_the_callers_prompt_list():
    prompt = [1, 2]
    seq = Sequence(0, None, prompt, 4)
    seq.append_token_id(3, {})
    assert prompt == [1, 2]


@pytest.mark.parametrize("length, block_size, blocks", [(1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2)])
def test_n_blocks_is_ceil_of_length_over_block_size(length, block_size, blocks):
    assert make_seq(prompt=range(1, length + 1), block_size=block_size).n_blocks == blocks
    assert blocks == math.ceil(length / block_size)


def test_prefill_then_decode_stages():
    seq = make_seq(prompt=[1, 2, 3, 4])
    assert seq.is_prefill() and seq.get_num_uncomputed_tokens() == 4
    seq.data.update_num_computed_tokens(2)  # a chunk of the prompt
    assert seq.is_prefill() and seq.data.stage == SequenceStage.PREFILL
    seq.data.update_num_computed_tokens(2)
    seq.append_token_id(9, {9: 0.0})
    assert not seq.is_prefill() and seq.get_num_uncomputed_tokens() == 1


def test_computed_tokens_cannot_exceed_length_and_reset_for_recompute():
    seq = make_seq(prompt=[1, 2, 3])
    with pytest.raises(ValueError):
        seq.data.update_num_computed_tokens(4)
    seq.data.update_num_computed_tokens(3)
    seq.append_token_id(4, {})
    seq.reset_state_for_recompute()
    assert seq.get_num_computed_tokens() == 0 and seq.get_num_uncomputed_tokens() == 4
    assert seq.is_prefill()  # prompt + outputs are prefilled again


def test_fork_copies_tokens_but_not_identity():
    parent = make_seq(prompt=[1, 2])
    parent.append_token_id(3, {3: -1.0})
    child = parent.fork(7)
    child.append_token_id(4, {4: -2.0})
    assert child.seq_id == 7 and parent.seq_id == 0
    assert parent.get_token_ids() == [1, 2, 3] and child.get_token_ids() == [1, 2, 3, 4]
    assert parent.get_cumulative_logprob() == -1.0 and child.get_cumulative_logprob() == -3.0
    assert len(parent.output_logprobs) == 1


def test_beam_search_score_is_logprob_over_length_power():
    # The formula vLLM and transformers document: sum_logprobs / (seq_len ** length_penalty),
    # where a trailing EOS does not count towards the length.
    seq = make_seq(prompt=[1, 2, 3])
    seq.append_token_id(4, {4: -1.0})
    seq.append_token_id(0, {0: -2.0})
    assert seq.get_beam_search_score(length_penalty=1.0) == pytest.approx(-3.0 / 5)
    assert seq.get_beam_search_score(length_penalty=2.0, eos_token_id=0) == pytest.approx(-3.0 / 4**2)


# ------------------------------------------------------------------- groups
def test_group_queries_by_status():
    seqs = [make_seq(i) for i in range(3)]
    group = SequenceGroup("r", seqs, arrival_time=1.0)
    seqs[0].status = SequenceStatus.RUNNING
    seqs[2].status = SequenceStatus.FINISHED_STOPPED
    assert group.get_seqs(SequenceStatus.RUNNING) == [seqs[0]]
    assert group.num_seqs() == 3 and group.num_seqs(SequenceStatus.WAITING) == 1
    assert group.get_unfinished_seqs() == seqs[:2] and group.get_finished_seqs() == [seqs[2]]
    assert not group.is_finished()
    group.set_status(SequenceStatus.FINISHED_ABORTED)  # only the unfinished ones change
    assert seqs[2].status == SequenceStatus.FINISHED_STOPPED and group.is_finished()


def test_group_needs_a_sequence_and_unique_ids():
    with pytest.raises(ValueError):
        SequenceGroup("r", [])
    group = SequenceGroup("r", [make_seq(1)])
    with pytest.raises(ValueError):
        group.add(make_seq(1))
    group.add(make_seq(2))
    assert group.find(2).seq_id == 2
    group.remove(1)
    with pytest.raises(ValueError):
        group.find(1)


def test_max_num_running_seqs_budgets_best_of_during_prefill():
    params = SamplingParams(n=2, best_of=3, temperature=0.8)
    group = SequenceGroup("r", [make_seq(0)], 0.0, params)
    assert group.get_max_num_running_seqs() == 3  # the prompt forks into best_of samples
    group.update_num_computed_tokens(3)
    group.first_seq.append_token_id(5, {})
    group.add(group.first_seq.fork(1))
    assert group.get_max_num_running_seqs() == 2  # decode: the unfinished sequences


def test_group_computed_tokens_move_together():
    group = SequenceGroup("r", [make_seq(0), make_seq(1)])
    group.update_num_computed_tokens(2)
    assert [s.get_num_computed_tokens() for s in group.get_seqs()] == [2, 2]
    assert group.get_num_uncomputed_tokens() == 2 and group.is_prefill()


# ------------------------------------------------------------ vLLM 0.6.3's signatures
def test_append_token_id_takes_vllms_logprob_dicts():
    seq = make_seq(0)
    seq.append_token_id(8, {8: Logprob(-0.5, rank=2), 9: Logprob(-1.5, rank=1)})
    assert seq.get_cumulative_logprob() == -0.5
    assert seq.output_logprobs[-1] == {8: -0.5, 9: -1.5} and seq.output_ranks[-1] == 2
    seq.append_token_id(9, {9: Logprob(-0.25)}, rank=1)  # an explicit rank wins
    assert seq.get_cumulative_logprob() == -0.75 and seq.output_ranks[-1] == 1


def test_sequence_group_takes_vllms_positional_order():
    params = SamplingParams(n=2)
    group = SequenceGroup("r", [make_seq(0)], 3.0, params, priority=1)
    assert (group.arrival_time, group.sampling_params, group.priority) == (3.0, params, 1)
    with pytest.raises(ValueError, match="arrival_time must be a number"):
        SequenceGroup("r", [make_seq(1)], params)  # sampling_params where arrival_time goes


def test_sequence_group_takes_vllms_keywords():
    params, seq = SamplingParams(), make_seq(0)
    # vLLM 0.6.3's whole positional order, its extras at their defaults.
    group = SequenceGroup("r", [seq], 2.0, params, None, None, None, None, None, None, 3)
    assert (group.arrival_time, group.lora_request, group.priority) == (2.0, None, 3)
    group = SequenceGroup(request_id="r", seqs=[make_seq(1)], arrival_time=0.0, sampling_params=params,
                          lora_request=None, embeddings=None, pooling_params=None, encoder_seq=None,
                          trace_headers=None, prompt_adapter_request=None, priority=0)
    assert group.priority == 0 and group.sampling_params is params


@pytest.mark.parametrize("name, value, reason", [
    ("embeddings", [0.5], "embedding"), ("pooling_params", object(), "embedding"),
    ("encoder_seq", make_seq(9), "encoder-decoder"), ("trace_headers", {"traceparent": "x"}, "tracing"),
    ("prompt_adapter_request", object(), "prompt adapters")])
def test_sequence_group_refuses_what_it_cannot_serve(name, value, reason):
    with pytest.raises(ValueError, match=f"{name} must be None in minivllm: .*{reason}"):
        SequenceGroup("r", [make_seq(0)], 0.0, **{name: value})


def test_lora_request_is_vllms_fifth_positional():
    from minivllm.lora.request import LoRARequest

    adapter = LoRARequest("a", 1, "/nowhere")
    group = SequenceGroup("r", [make_seq(0)], 0.0, SamplingParams(), adapter)
    assert group.lora_request is adapter and group.lora_int_id == 1
