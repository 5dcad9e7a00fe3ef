"""`RequestOutputKind.DELTA`: each output carries only what is new since the request's last one.

The reference is the same request run with CUMULATIVE outputs: its deltas, appended in order,
must give exactly the cumulative output (text, token ids, logprobs), whatever the number of
sequences, scheduler steps or stop strings. A stop string's first characters are held back
while it could still be completing, so a stream never shows text the engine later cuts.
"""

from __future__ import annotations

import copy

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "ROMEO: what light"


@pytest.fixture(scope="module", params=[1, 4], ids=["single-step", "multi-step"])
def engine(request, tiny_llama) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama[0], device="cpu", block_size=8,
                                                 num_scheduler_steps=request.param))


def every_output(engine: LLMEngine, request_id: str, params: SamplingParams) -> list[RequestOutput]:
    """All outputs of one request, the partial ones of a multi-step run included (as a stream sees them)."""
    engine.add_request(request_id, PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step(seen.extend)
    return [o for o in seen if o.request_id == request_id]


def joined(deltas: list[RequestOutput]) -> RequestOutput:
    first, *rest = copy.deepcopy(deltas)  # `add` merges in place
    for delta in rest:
        first.add(delta)
    return first


def params(kind: RequestOutputKind, **overrides) -> SamplingParams:
    base = dict(n=2, temperature=0.9, seed=11, max_tokens=14, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return SamplingParams(**{**base, **overrides}, output_kind=kind)


def test_deltas_add_up_to_the_cumulative_output(engine):
    cumulative = every_output(engine, "c", params(RequestOutputKind.CUMULATIVE))
    deltas = every_output(engine, "d", params(RequestOutputKind.DELTA))
    final, rebuilt = cumulative[-1], joined(deltas)
    assert rebuilt.finished and len(rebuilt.outputs) == 2
    for whole, added in zip(final.outputs, rebuilt.outputs):
        assert (added.index, added.text, added.token_ids) == (whole.index, whole.text, whole.token_ids)
        assert added.logprobs == whole.logprobs and added.finish_reason == whole.finish_reason == "length"
    assert rebuilt.prompt_logprobs == final.prompt_logprobs
    # Each delta is small: one token per sequence per model step, the prompt's logprobs once.
    assert max(len(c.token_ids) for d in deltas for c in d.outputs) == 1
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1


def test_a_stop_string_is_never_streamed_and_then_taken_back(engine):
    full = every_output(engine, "full", params(RequestOutputKind.CUMULATIVE, n=1))[-1].outputs[0].text
    stop = full[7:10]  # spans three tokens of the character tokenizer
    expected = full[: full.index(stop)]
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        outputs = every_output(engine, f"stop-{kind.name}", params(kind, n=1, stop=[stop]))
        texts = [o.outputs[0].text for o in outputs]
        shown = [texts[i] if kind == RequestOutputKind.CUMULATIVE else "".join(texts[: i + 1]) for i in range(len(texts))]
        assert shown[-1] == expected and outputs[-1].outputs[0].finish_reason == "stop"
        assert all(expected.startswith(text) for text in shown), (kind, shown)  # never more than the final text


def test_delta_needs_stable_sequences():
    with pytest.raises(ValueError, match="output_kind DELTA"):
        SamplingParams(n=1, best_of=3, temperature=1.0, output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match="output_kind DELTA"):
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)


def test_the_pipeline_parallel_engine_returns_whole_outputs_for_a_delta_request(tiny_llama):
    """`PipelineParallelEngine.run()` keeps finished outputs only: it asks for FINAL_ONLY, as
    `LLM.generate` does, so a DELTA request still gets its whole output (a review found only
    its last piece)."""
    from minivllm.engine.pipeline_parallel_engine import PipelineParallelEngine

    engine = PipelineParallelEngine.from_engine_args(EngineArgs(model=tiny_llama[0], device="cpu", block_size=8,
                                                                pipeline_parallel_size=2))
    try:
        greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("c", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(**greedy))
        engine.add_request("d", {"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(**greedy, output_kind=RequestOutputKind.DELTA))
        outputs = {o.request_id: o.outputs[0] for o in engine.run()}
    finally:
        engine.shutdown()
    assert len(outputs["c"].token_ids) == 6 and outputs["d"].token_ids == outputs["c"].token_ids
