"""`SamplingParams`: vLLM's defaults and its validation rules (each a ValueError)."""

from __future__ import annotations

import pytest

from minivllm.sampling_params import SamplingParams, SamplingType


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
