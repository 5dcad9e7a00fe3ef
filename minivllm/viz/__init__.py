"""Drawing functions and widgets for notebooks.

Each picture is a pure function that takes state and a matplotlib `Axes`; each widget is an
ipywidgets stepper over a recorded trace, with a static small-multiples twin.
"""

from minivllm.viz.archmap import draw_architecture, import_graph
from minivllm.viz.memory import draw_memory_waste
from minivllm.viz.model import (
    draw_gqa_groups,
    draw_rope_angles,
    draw_rope_rotation,
    draw_rope_wavelengths,
)
from minivllm.viz.style import COLORS, REQUEST_PALETTE, request_color

__all__ = [
    "COLORS",
    "REQUEST_PALETTE",
    "draw_architecture",
    "draw_gqa_groups",
    "draw_memory_waste",
    "draw_rope_angles",
    "draw_rope_rotation",
    "draw_rope_wavelengths",
    "import_graph",
    "request_color",
]
