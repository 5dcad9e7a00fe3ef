"""Course tooling: pictures, widgets, snapshots and the simulator, outside the runtime.

Each picture is a pure function that takes state and a matplotlib `Axes`; each widget is an
ipywidgets stepper over a recorded trace, with a static small-multiples twin. Snapshots
(`minivllm.viz.snapshot`) and the simulator (`minivllm.viz.sim`) observe the real engine
through its public hook (`LLMEngine.add_step_observer`) and public queries.

The names below are imported on first use (PEP 562), so `minivllm.viz.sim`,
`minivllm.viz.snapshot` and `minivllm.viz.layers` work without matplotlib or ipywidgets
(the `notebooks` extra).
"""

from __future__ import annotations

import importlib

_EXPORTS: dict[str, str] = {
    "batch_grid": "minivllm.viz.queues",
    "batch_grid_stepper": "minivllm.viz.queues",
    "COLORS": "minivllm.viz.style",
    "draw_architecture": "minivllm.viz.archmap",
    "draw_batch_grid": "minivllm.viz.queues",
    "draw_batch_grid_small_multiples": "minivllm.viz.queues",
    "draw_batch_tokens": "minivllm.viz.queues",
    "draw_block_pool": "minivllm.viz.blocks",
    "draw_block_tables": "minivllm.viz.blocks",
    "draw_block_usage": "minivllm.viz.blocks",
    "draw_connector_calls": "minivllm.viz.kv_transfer",
    "draw_free_lists": "minivllm.viz.blocks",
    "draw_gqa_groups": "minivllm.viz.model",
    "draw_hash_chain": "minivllm.viz.blocks",
    "draw_latency_tradeoff": "minivllm.viz.queues",
    "draw_memory_over_time": "minivllm.viz.queues",
    "draw_memory_waste": "minivllm.viz.memory",
    "draw_pd_split": "minivllm.viz.kv_transfer",
    "draw_preemption_costs": "minivllm.viz.queues",
    "draw_queues": "minivllm.viz.queues",
    "draw_queues_small_multiples": "minivllm.viz.queues",
    "draw_ref_counts": "minivllm.viz.blocks",
    "draw_rope_angles": "minivllm.viz.model",
    "draw_rope_rotation": "minivllm.viz.model",
    "draw_rope_wavelengths": "minivllm.viz.model",
    "draw_small_multiples": "minivllm.viz.widgets",
    "draw_transfer_costs": "minivllm.viz.kv_transfer",
    "FrameStepper": "minivllm.viz.widgets",
    "import_graph": "minivllm.viz.archmap",
    "queue_events": "minivllm.viz.queues",
    "queue_stepper": "minivllm.viz.queues",
    "render_frame": "minivllm.viz.widgets",
    "request_color": "minivllm.viz.style",
    "REQUEST_PALETTE": "minivllm.viz.style",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minivllm.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value
