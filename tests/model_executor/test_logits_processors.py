"""`SamplingParams.logits_processors` (vLLM's two signatures), applied before everything else."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import InvalidParameterError


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def _tokens(llm, **params) -> list[int]:
    return list(llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=8, **params))[0].outputs[0].token_ids)


def test_a_processor_changes_greedy_output_exactly_where_it_acts(llm):
    plain = _tokens(llm)

    def ban_first(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[plain[0]] = -float("inf")
        return logits

    banned = _tokens(llm, logits_processors=[ban_first])
    assert banned[0] != plain[0] and plain[0] not in banned


def test_the_three_argument_form_sees_the_prompt(llm):
    seen = []

    def force(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append((len(prompt_ids), len(output_ids)))
        forced = torch.full_like(logits, -float("inf"))
        forced[42] = 0.0
        return forced

    assert _tokens(llm, logits_processors=[force], ignore_eos=True) == [42] * 8
    assert [out for _, out in seen] == list(range(8)) and len({p for p, _ in seen}) == 1


def test_processors_are_checked_and_shared_by_clone():
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(logits_processors=["not callable"])
    assert error.value.param == "logits_processors"
    state = {"calls": 0}

    def counting(output_ids, logits):
        state["calls"] += 1
        return logits

    params = SamplingParams(logits_processors=[counting])
    assert params.clone().logits_processors[0] is counting
