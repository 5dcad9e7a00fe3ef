"""The picture of a mixed LoRA batch: each row through its own adapter, in one launch.

`draw_lora_batch(ax, token_lora_indices, num_slots)` draws, left to right:
    the batch as the model runner built it (one row per token, coloured by its adapter's slot;
    grey rows run the base model), the same rows grouped by slot (what the kernels'
    `sorted_token_ids` does, cut into BLOCK_M-row tiles: one program each), and the slot
    table: per slot A [r x K] (shrink: K -> r) and B [N x r] (expand: r -> N).
Plain lists in, no kernels imported: the notebook passes what `LoRAMapping` holds.
"""

from __future__ import annotations

from minivllm.viz.style import COLORS, request_color

NO_LORA = -1


def group_by_slot(token_lora_indices: list[int]) -> list[int]:
    """Row indices grouped by slot, base-model rows first (a stable sort, as the kernels')."""
    return sorted(range(len(token_lora_indices)), key=lambda t: token_lora_indices[t])


def _row_color(slot: int) -> str:
    return COLORS["idle"] if slot == NO_LORA else request_color(slot)


def draw_lora_batch(ax, token_lora_indices: list[int], num_slots: int, block_m: int = 4) -> None:
    n = len(token_lora_indices)
    ax.set_xlim(-0.5, 12.5)
    ax.set_ylim(n + 1.5, -1.5)
    ax.axis("off")
    for t, slot in enumerate(token_lora_indices):  # the batch in order
        ax.add_patch(_box(0, t, 2, _row_color(slot)))
        ax.text(1, t + 0.45, f"row {t}" + ("" if slot == NO_LORA else f" -> slot {slot}"), ha="center",
                va="center", fontsize=7)
    for pos, t in enumerate(group_by_slot(token_lora_indices)):  # grouped by slot
        slot = token_lora_indices[t]
        ax.add_patch(_box(4, pos, 2, _row_color(slot), hatch=None if slot != NO_LORA else "//"))
        ax.text(5, pos + 0.45, f"row {t}", ha="center", va="center", fontsize=7)
    _draw_tiles(ax, token_lora_indices, block_m)
    for slot in range(num_slots):  # the slot table
        y = slot * (n + 1) / max(num_slots, 1)
        ax.add_patch(_box(8.5, y, 1.2, request_color(slot), height=0.8))
        ax.add_patch(_box(10.3, y, 0.5, request_color(slot), height=0.8 * 2))
        ax.text(9.1, y + 0.4, f"A[{slot}]", ha="center", va="center", fontsize=7, color="white")
        ax.text(10.55, y + 0.8, f"B[{slot}]", ha="center", va="center", fontsize=6, color="white", rotation=90)
    for x, title in ((1, "batch (model runner)"), (5, "grouped by slot"), (9.6, "slots: A (shrink), B (expand)")):
        ax.text(x, -1, title, ha="center", fontsize=8, weight="bold")


def _draw_tiles(ax, token_lora_indices: list[int], block_m: int) -> None:
    """A bracket per program: up to block_m rows of one slot."""
    order = group_by_slot(token_lora_indices)
    start = 0
    while start < len(order):
        slot = token_lora_indices[order[start]]
        end = start
        while end < len(order) and token_lora_indices[order[end]] == slot and end - start < block_m:
            end += 1
        if slot == NO_LORA:
            ax.text(6.3, (start + end) / 2, "base model:\nskipped", va="center", fontsize=6)
        else:
            ax.plot([6.2, 6.4, 6.4, 6.2], [start + 0.05, start + 0.05, end - 0.15, end - 0.15], color=COLORS["edge"], lw=1)
            ax.text(6.55, (start + end) / 2, f"program\n(slot {slot})", va="center", fontsize=6)
        start = end


def _box(x: float, y: float, width: float, color: str, height: float = 0.9, hatch: str | None = None):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, facecolor=color, edgecolor=COLORS["edge"], lw=0.5, hatch=hatch)
