"""The LoRA batch picture groups rows exactly as the kernels' mapping does."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.kernels.lora_reference import LoRAMapping  # noqa: E402
from minivllm.viz.lora import draw_lora_batch, group_by_slot  # noqa: E402


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=20))
def test_group_by_slot_is_the_mapping_order(indices):
    assert group_by_slot(indices) == LoRAMapping.build(torch.tensor(indices), 4).sorted_token_ids.tolist()


def test_draw_lora_batch_draws_every_row_twice_and_each_slot():
    fig, ax = plt.subplots()
    draw_lora_batch(ax, [1, -1, 0, 1], num_slots=2)
    texts = [t.get_text() for t in ax.texts]
    assert sum(t.startswith("row ") for t in texts) == 8 and {"A[0]", "A[1]", "B[0]", "B[1]"} <= set(texts)
    plt.close(fig)
