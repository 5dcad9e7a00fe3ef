"""Speculative decoding's pictures: the recorder sees every round, and the measured-against-expected
picture draws every row it is given."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from minivllm.viz.spec_decode import SpecDecodeRecorder, draw_measured_speedups, row_label  # noqa: E402

ROWS = [{"workload": "repeat", "batch": 1, "proposer": "ngram", "speedup": 1.21, "expected_speedup": 3.10},
        {"workload": "free", "batch": 64, "proposer": "draft", "speedup": 0.40, "expected_speedup": 0.61}]


def test_row_label_names_proposer_batch_and_workload():
    assert [row_label(r) for r in ROWS] == ["n-gram, batch 1, repeat", "draft, batch 64, free"]


def test_two_bars_per_row_labelled_with_their_values():
    fig, ax = plt.subplots()
    draw_measured_speedups(ax, ROWS, title="H100")
    assert len(ax.patches) == 2 * len(ROWS)
    assert sorted(p.get_width() for p in ax.patches) == [0.40, 0.61, 1.21, 3.10]
    texts = [t.get_text() for t in ax.texts]
    assert {" 1.21×", " 3.10×", " 0.40×", " 0.61×"} == set(texts)
    assert [t.get_text() for t in ax.get_yticklabels()] == [row_label(r) for r in ROWS]
    assert ax.get_title() == "H100"
    plt.close(fig)


def test_labels_override_the_row_names():
    fig, ax = plt.subplots()
    draw_measured_speedups(ax, ROWS, labels=["a", "b"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    plt.close(fig)


def test_the_recorder_sees_each_round_of_a_request_and_what_it_emitted():
    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny-shakespeare", device="cpu", speculative_model="[ngram]",
                                                   num_speculative_tokens=3, ngram_prompt_lookup_max=3))
    recorder = SpecDecodeRecorder(engine)
    engine.add_request("0", {"prompt_token_ids": [5, 6, 7, 8] * 6}, SamplingParams(temperature=0.0, max_tokens=24,
                                                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
    steps = recorder.of_request("0")
    emitted = [token for step in steps for token in step.emitted]
    # The prefill samples the first token; every later one came out of a recorded round (the
    # last round may emit past max_tokens, which the engine drops).
    assert emitted[: len(tokens) - 1] == tokens[1:] and len(emitted) >= len(tokens) - 1
    assert any(step.num_accepted for step in steps) and all(len(step.proposed) <= 3 for step in steps)
