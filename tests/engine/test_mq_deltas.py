"""Outputs as deltas between the engine process and the server (`engine/multiprocessing/deltas.py`):
whatever the outputs do from step to step, the client rebuilds exactly what the engine had."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.multiprocessing.deltas import OutputDeltaDecoder, OutputDeltaEncoder
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sequence import Logprob


def output(tokens_per_completion, finished=False, texts=None, logprobs=False, prompt_logprobs=None, rid="r"):
    completions = []
    for index, tokens in enumerate(tokens_per_completion):
        text = texts[index] if texts else "".join(f" t{t}" for t in tokens)
        lps = [{t: Logprob(-0.5)} for t in tokens] if logprobs else None
        completions.append(CompletionOutput(index, text, list(tokens), -1.0 if logprobs else None, lps,
                                            "length" if finished else None))
    return RequestOutput(rid, "ROMEO:", [1, 2, 3] * 200, prompt_logprobs, completions, finished, None, 0)


def roundtrip(steps):
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    wires = [encoder.encode(step) for step in steps]
    rebuilt = [decoder.decode(pickle.loads(pickle.dumps(wire))) for wire in wires]
    return wires, rebuilt, encoder, decoder


def test_a_growing_completion_sends_the_prompt_once_and_then_only_new_tokens():
    steps = [output([list(range(n))]) for n in range(1, 40)] + [output([list(range(40))], finished=True)]
    wires, rebuilt, encoder, decoder = roundtrip(steps)
    assert rebuilt == steps
    assert wires[0][1] == ("ROMEO:", [1, 2, 3] * 200) and all(w[1] is None for w in wires[1:])
    assert all(w[3][0][0] and w[3][0][3] == [n] for n, w in enumerate(wires[1:-1], 1))  # one new token each
    assert not encoder._sent and not decoder._last  # a finished request leaves no state behind
    whole = sum(len(pickle.dumps(step)) for step in steps)
    assert sum(len(pickle.dumps(w)) for w in wires) < whole / 10


def test_text_that_shrinks_and_tokens_that_change_are_sent_whole():
    steps = [output([[5, 6]], texts=["ab STO"]),
             output([[5, 6, 7]], texts=["ab"]),  # a stop string trimmed the text
             output([[9, 6, 7, 8]], texts=["ab cd"]),  # beam search swapped a beam's tokens
             output([[9, 6, 7, 8], [4]], finished=True, texts=["ab cd", "x"])]  # a second completion appears
    wires, rebuilt, _, _ = roundtrip(steps)
    assert rebuilt == steps
    assert [w[3][0][0] for w in wires] == [False, False, False, True]


def test_logprobs_and_prompt_logprobs_arrive_whole_at_the_client():
    prompt_lps = [None] + [{2: Logprob(-1.0)}] * 599
    steps = [output([[1] * n], logprobs=True, prompt_logprobs=prompt_lps) for n in range(1, 6)]
    wires, rebuilt, _, _ = roundtrip(steps)
    assert rebuilt == steps
    assert wires[0][2] == prompt_lps and all(w[2] is None for w in wires[1:])  # sent once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 50), max_size=8), st.text(max_size=6), st.booleans()),
                min_size=1, max_size=12))
def test_any_sequence_of_outputs_is_rebuilt_exactly(changes):
    """Each step either appends to the tokens and text or replaces them; interleaved requests."""
    steps, tokens, text = [], [], ""
    for i, (new_tokens, new_text, replace) in enumerate(changes):
        tokens, text = (new_tokens, new_text) if replace else (tokens + new_tokens, text + new_text)
        steps.append(output([tokens], texts=[text], rid="a"))
        steps.append(output([tokens[:i]], texts=[text[:i]], rid="b"))
    assert roundtrip(steps)[1] == steps


def test_delta_outputs_pass_through_with_the_prompt_once():
    """A DELTA request's outputs are deltas already: sent as they are, nothing rebuilt at the client."""
    prompt_lps = [None, {2: Logprob(-1.0)}]
    steps = [output([[n]], texts=[f" t{n}"], logprobs=True, prompt_logprobs=prompt_lps if n == 0 else None)
             for n in range(5)] + [output([[5]], texts=[" t5"], finished=True)]
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    encoder.add_delta_request("r")
    decoder.add_delta_request("r")
    wires = [encoder.encode(step) for step in steps]
    rebuilt = [decoder.decode(pickle.loads(pickle.dumps(wire))) for wire in wires]
    assert rebuilt == steps  # each delta as the engine made it; prompt logprobs in the first only
    assert wires[0][1] == ("ROMEO:", [1, 2, 3] * 200) and all(w[1] is None for w in wires[1:])
    assert not encoder._sent and not encoder._delta_ids and not decoder._last and not decoder._delta_ids
