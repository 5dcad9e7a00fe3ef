"""The one colour scheme of minivllm: every figure and widget takes its colours from here.

Colours follow the pictures learners already know (vLLM's launch-blog block animations and
the static-vs-continuous batching grid) and are distinguishable in colour-blind palettes
(Okabe-Ito).
"""

from __future__ import annotations

# Roles, not hues: code asks for COLORS["prompt"], never for "orange".
COLORS = {
    # tokens and slots
    "prompt": "#E69F00",  # prompt tokens / prefill
    "generated": "#56B4E9",  # generated tokens / decode
    "finished": "#009E73",  # end-of-sequence slot
    "idle": "#E5E5E5",  # padding, idle batch slot, wasted memory
    # blocks
    "free": "#FFFFFF",  # a free physical block
    "used": "#0072B2",  # a block held by exactly one sequence
    "shared": "#CC79A7",  # a block with reference count > 1
    "cached": "#F0E442",  # an unreferenced block kept by the prefix cache
    "copied": "#D55E00",  # the destination of a copy-on-write
    # queues and pools
    "waiting": "#999999",
    "running": "#0072B2",
    "swapped": "#D55E00",
    "gpu": "#0072B2",
    "cpu": "#009E73",
    "edge": "#333333",
}

# A palette for telling requests apart (sequence 0, 1, 2, ...).
REQUEST_PALETTE = [
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000",
]


def request_color(index: int) -> str:
    """A stable colour for the `index`-th request or sequence."""
    return REQUEST_PALETTE[index % len(REQUEST_PALETTE)]
