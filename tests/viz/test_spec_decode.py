"""The measured-against-expected picture of speculative decoding draws every row it is given."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm.viz.spec_decode import draw_measured_speedups, row_label  # noqa: E402

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
