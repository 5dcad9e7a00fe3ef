"""`SamplingParams`: vLLM's defaults and its validation rules (each a ValueError naming the field)."""

from __future__ import annotations

import pytest

from minivllm.sampling_params import MAX_LENGTH_PENALTY, InvalidParameterError, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos and p.skip_special_tokens
    assert p.sampling_type == SamplingType.RANDOM


def test_best_of_defaults_to_n_and_must_not_be_smaller():
    assert SamplingParams(n=3).best_of == 3
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=1)


@pytest.mark.parametrize("kwargs, name", [
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.1), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(seed=1.5), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop="x", detokenize=False), "stop"),
])
def test_invalid_values_raise_value_error_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_greedy_resets_filters_and_forbids_best_of():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1)
    assert p.sampling_type == SamplingType.GREEDY and (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(temperature=0.0, n=2)


def test_beam_search_rules():
    p = SamplingParams(use_beam_search=True, best_of=4, temperature=0.0)
    assert p.sampling_type == SamplingType.BEAM
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(use_beam_search=True, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.7)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, top_k=5)
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, early_stopping="sometimes")


def test_seeded_sampling_type_and_stop_normalisation():
    p = SamplingParams(seed=3, stop="###", stop_token_ids=[7])
    assert p.sampling_type == SamplingType.RANDOM_SEED
    assert p.stop == ["###"] and p.all_stop_token_ids == {7}


def test_clone_is_deep():
    p = SamplingParams(stop=["a"])
    q = p.clone()
    q.stop.append("b")
    assert p.stop == ["a"] and q == SamplingParams(stop=["a", "b"])


# ------------------------------------------------- hostile values (issue 13)
@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(min_p=float("-inf")), "min_p"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(temperature="hot"), "temperature"), (dict(temperature=None), "temperature"), (dict(top_p=True), "top_p"),
    (dict(seed=True), "seed"), (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed="7"), "seed"),
    (dict(top_k=2**63), "top_k"), (dict(top_k=1.0), "top_k"), (dict(n=True), "n"), (dict(best_of=2**63), "best_of"),
    (dict(max_tokens=2**63), "max_tokens"), (dict(max_tokens="16"), "max_tokens"), (dict(logprobs=2**63), "logprobs"),
    (dict(length_penalty=400.0), "length_penalty"), (dict(length_penalty=-1e300), "length_penalty"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(skip_special_tokens=1), "skip_special_tokens"), (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(ignore_eos=None), "ignore_eos"), (dict(detokenize=0), "detokenize"), (dict(use_beam_search="yes"), "use_beam_search"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(spaces_between_special_tokens="x"), "spaces_between_special_tokens"),
    (dict(early_stopping=1), "early_stopping"), (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(stop=5), "stop"), (dict(stop=[None]), "stop"), (dict(stop=b"x"), "stop"),
    (dict(stop_token_ids=3), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"), (dict(stop_token_ids=["7"]), "stop_token_ids"),
    (dict(output_kind="final"), "output_kind"),
])
def test_hostile_values_raise_a_value_error_naming_the_field(kwargs, name):
    """Wrong types, NaN, infinities and integers beyond what torch holds: a ValueError with the
    field in its message and in `param`, never a TypeError from a comparison."""
    with pytest.raises(ValueError, match=name) as refused:
        SamplingParams(**kwargs)
    assert isinstance(refused.value, InvalidParameterError) and refused.value.param == name


def test_the_extremes_that_fit_are_accepted_as_plain_python_numbers():
    numpy = pytest.importorskip("numpy")
    p = SamplingParams(seed=2**64 - 1, top_k=2**63 - 1, length_penalty=-MAX_LENGTH_PENALTY, temperature=numpy.float32(0.5),
                       max_tokens=numpy.int64(7), stop_token_ids=(numpy.int32(3),))
    assert (p.seed, p.top_k, p.max_tokens, p.stop_token_ids) == (2**64 - 1, 2**63 - 1, 7, [3])
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(early_stopping="never", use_beam_search=True, best_of=2, temperature=0).early_stopping == "never"


def test_the_error_survives_pickling_with_its_field():
    import pickle

    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(top_p=2.0)
    copy = pickle.loads(pickle.dumps(refused.value))
    assert (copy.param, str(copy)) == ("top_p", str(refused.value))
