"""Drawing functions and widgets for notebooks.

Each picture is a pure function that takes state and a matplotlib `Axes`; each widget is an
ipywidgets stepper over a recorded trace, with a static small-multiples twin.
"""

from minivllm.viz.archmap import draw_architecture, import_graph
from minivllm.viz.blocks import (
    draw_block_pool,
    draw_block_tables,
    draw_block_usage,
    draw_free_lists,
    draw_hash_chain,
    draw_ref_counts,
)
from minivllm.viz.memory import draw_memory_waste
from minivllm.viz.model import (
    draw_gqa_groups,
    draw_rope_angles,
    draw_rope_rotation,
    draw_rope_wavelengths,
)
from minivllm.viz.queues import (
    batch_grid,
    batch_grid_stepper,
    draw_batch_grid,
    draw_batch_grid_small_multiples,
    draw_batch_tokens,
    draw_latency_tradeoff,
    draw_memory_over_time,
    draw_preemption_costs,
    draw_queues,
    draw_queues_small_multiples,
    queue_stepper,
)
from minivllm.viz.style import COLORS, REQUEST_PALETTE, request_color
from minivllm.viz.widgets import FrameStepper, draw_small_multiples, render_frame

__all__ = [
    "COLORS",
    "REQUEST_PALETTE",
    "batch_grid",
    "batch_grid_stepper",
    "draw_batch_grid",
    "draw_batch_grid_small_multiples",
    "draw_batch_tokens",
    "draw_latency_tradeoff",
    "draw_memory_over_time",
    "draw_preemption_costs",
    "draw_queues",
    "draw_queues_small_multiples",
    "queue_stepper",
    "draw_architecture",
    "draw_gqa_groups",
    "draw_memory_waste",
    "draw_rope_angles",
    "draw_rope_rotation",
    "draw_rope_wavelengths",
    "import_graph",
    "request_color",
    "FrameStepper",
    "draw_block_pool",
    "draw_block_tables",
    "draw_block_usage",
    "draw_free_lists",
    "draw_hash_chain",
    "draw_ref_counts",
    "draw_small_multiples",
    "render_frame",
]
