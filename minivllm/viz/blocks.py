"""Pictures of the paged KV cache, drawn from `snapshot_block_manager(...)` (`minivllm.viz.snapshot`).

Every function is pure: it takes a `BlockManagerSnapshot` (or a list of them) and a
matplotlib `Axes`, draws, and returns nothing. The main picture is the one from vLLM's
launch blog: each sequence's logical blocks on the left, arrows through its block table to
the physical blocks on the right, with reference counts.

    draw_block_tables(snapshot, ax)    logical blocks -> physical GPU (and CPU) blocks
    draw_block_pool(snapshot, ax)      one device's blocks coloured by state, with ref counts
    draw_free_lists(snapshot, ax)      the free list (FIFO) and the evictable cached blocks (LRU)
    draw_ref_counts(snapshot, ax)      reference count per physical block
    draw_hash_chain(snapshot, seq_id, ax)   prefix-caching hashes of one sequence's full blocks
    draw_block_usage(snapshots, ax)    free / referenced / cached blocks over a trace

Block colours (from `minivllm.viz.style.COLORS`): free, used (one holder), shared (ref > 1),
cached (kept by the prefix cache with no holder), copied (a copy-on-write destination). A
block registered in the prefix cache while still in use gets a thick outline in the cached colour.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import matplotlib.colors as mcolors
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minivllm.viz.snapshot import BlockManagerSnapshot, BlockSnapshot
from minivllm.viz.style import COLORS, request_color

__all__ = ["block_state", "draw_block_pool", "draw_block_tables", "draw_block_usage",
           "draw_free_lists", "draw_hash_chain", "draw_ref_counts", "short_hash"]

TokenLabels = Mapping[int, str] | Callable[[int], str] | None

_CELL = 1.0  # width of one token slot
_ROW = 1.4  # vertical distance between rows of blocks
_BLOCK_GAP = 0.35  # space between two logical blocks of a sequence
_POOL_GAP = 3.0  # space between the logical side and the physical pool
_ROWS_PER_COLUMN = 8  # physical blocks per column before wrapping to the next
_COLUMN_GAP = 3.6  # room for the '#n' and 'ref n' labels between two columns of blocks
_MAX_TOKEN_CHARS = 5  # characters that fit a cell at the full token font size
_TOKEN_FONT = 6.0
_MIN_TOKEN_FONT = 5.0  # below this a token is unreadable once a page scales the figure down
_TINT = 0.33  # a sequence's colour over white for its logical blocks
_HASH_DIGITS = 4  # hex digits of a block hash shown (enough to tell blocks apart)


# ===================================================================== helpers
def _label(token_id: int, token_labels: TokenLabels) -> str:
    if token_labels is None:
        text = str(token_id)
    elif callable(token_labels):
        text = token_labels(token_id)
    else:
        text = token_labels.get(token_id, str(token_id))
    return text


def _label_fontsize(text: str) -> float:
    """Longer tokens get a smaller font so they fit their cell, down to a legible minimum."""
    return max(_MIN_TOKEN_FONT, min(_TOKEN_FONT, _TOKEN_FONT * _MAX_TOKEN_CHARS / max(len(text), 1)))


def _fit_label(text: str) -> str:
    """The token as it fits its cell at `_label_fontsize`: cut with '…' past what fits at the
    minimum font ("mathematician" -> "mathe…"), never overlapping its neighbours."""
    fits = int(_MAX_TOKEN_CHARS * _TOKEN_FONT / _MIN_TOKEN_FONT)
    return text if len(text) <= fits else text[:fits - 1] + "…"


def _tint(color: str) -> tuple[float, float, float]:
    """`color` at `_TINT` over white, opaque: an arrow drawn beneath stays hidden under the block."""
    r, g, b = mcolors.to_rgb(color)
    return tuple(1 - _TINT * (1 - c) for c in (r, g, b))


def block_state(block: BlockSnapshot) -> str:
    """'free', 'used', 'shared' or 'cached': the colour role of a physical block."""
    if block.ref_count > 1:
        return "shared"
    if block.ref_count == 1:
        return "used"
    return "cached" if block.cached else "free"


def short_hash(block_hash: int | None) -> str:
    """A few hex digits of a block hash, for labels ('-' for no hash)."""
    return "-" if block_hash is None else format(block_hash & (16**_HASH_DIGITS - 1), f"0{_HASH_DIGITS}x")


def _draw_slots(ax, x: float, y: float, block_size: int, tokens: Sequence[int], face: str,
                token_labels: TokenLabels, edge: str = COLORS["edge"], linewidth: float = 1.2) -> None:
    """One block as `block_size` cells at (x, y) (bottom-left), filled cells in `face`."""
    for i in range(block_size):
        filled = i < len(tokens)
        ax.add_patch(Rectangle((x + i * _CELL, y), _CELL, _CELL, facecolor=face if filled else "white",
                               edgecolor=edge, linewidth=linewidth))
        if filled:
            text = _fit_label(_label(tokens[i], token_labels))
            ax.text(x + (i + 0.5) * _CELL, y + 0.5 * _CELL, text, ha="center", va="center",
                    fontsize=_label_fontsize(text))


def _block_width(block_size: int) -> float:
    return block_size * _CELL


def _pool_rows(num_blocks: int, rows_per_column: int) -> int:
    """Rows of the pool's columns, balanced: 10 blocks are 2 columns of 5, not 8 + 2 (a shorter
    picture, so its cells are drawn larger at the same figure size)."""
    columns = -(-max(1, num_blocks) // rows_per_column)
    return -(-max(1, num_blocks) // columns)


def _pool_position(index: int, x0: float, block_size: int, rows: int) -> tuple[float, float]:
    column, row = divmod(index, rows)
    return x0 + column * (_block_width(block_size) + _COLUMN_GAP), -row * _ROW


def _legend(ax, roles: Sequence[str], loc: str = "upper center") -> None:
    handles = [Patch(facecolor=COLORS[r], edgecolor=COLORS["edge"], label=r) for r in roles]
    ax.legend(handles=handles, loc=loc, bbox_to_anchor=(0.5, -0.02), ncol=len(roles), fontsize=8,
              frameon=False)


# =============================================================== block tables
def draw_block_tables(snapshot: BlockManagerSnapshot, ax, *, seq_ids: Sequence[int] | None = None,
                      token_labels: TokenLabels = None, copied: Collection[int] = (),
                      show_cpu: bool | None = None, rows_per_column: int = _ROWS_PER_COLUMN) -> None:
    """The vLLM-blog picture: logical blocks -> block table -> physical blocks.

    Args:
        snapshot: `snapshot_block_manager(block_manager, seqs)` (`minivllm.viz.snapshot`).
        ax: the matplotlib Axes.
        seq_ids: which sequences to draw (default: all, in id order).
        token_labels: token id -> text (a dict or a function), e.g. a tokenizer's decode.
        copied: GPU block numbers to mark as copy-on-write destinations.
        show_cpu: draw the CPU pool too (default: when any sequence is swapped out).
        rows_per_column: at most this many physical blocks per column of the pool (the
            columns balanced: 10 blocks are 2 columns of 5).
    """
    size = snapshot.block_size
    tables = {**snapshot.gpu_block_tables, **snapshot.cpu_block_tables}
    seq_ids = sorted(tables) if seq_ids is None else list(seq_ids)
    if show_cpu is None:
        show_cpu = bool(snapshot.cpu_block_tables)
    max_blocks = max((len(tables[s]) for s in seq_ids), default=1)
    logical_width = max(1, max_blocks) * (_block_width(size) + _BLOCK_GAP)
    gpu_x = logical_width + _POOL_GAP
    rows = _pool_rows(snapshot.num_gpu_blocks, rows_per_column)
    gpu_columns = -(-snapshot.num_gpu_blocks // rows)
    cpu_x = gpu_x + gpu_columns * (_block_width(size) + _COLUMN_GAP) + 1.0
    positions = {("gpu", b.block_number): _pool_position(b.block_number, gpu_x, size, rows)
                 for b in snapshot.gpu_blocks}
    _draw_pool_blocks(ax, snapshot.gpu_blocks, positions, "gpu", size, token_labels, set(copied))
    ax.text(gpu_x, _ROW * 0.9, "GPU blocks (physical)", fontsize=9, fontweight="bold", color=COLORS["gpu"])
    if show_cpu and snapshot.num_cpu_blocks:
        cpu_rows = _pool_rows(snapshot.num_cpu_blocks, rows_per_column)
        positions.update({("cpu", b.block_number): _pool_position(b.block_number, cpu_x, size, cpu_rows)
                          for b in snapshot.cpu_blocks})
        _draw_pool_blocks(ax, snapshot.cpu_blocks, positions, "cpu", size, token_labels, set())
        ax.text(cpu_x, _ROW * 0.9, "CPU blocks (swap)", fontsize=9, fontweight="bold", color=COLORS["cpu"])
    ax.text(0, _ROW * 0.9, "logical blocks  (block table)", fontsize=9, fontweight="bold")
    y_bottom = _draw_sequences(ax, snapshot, seq_ids, tables, positions, token_labels, show_cpu)
    pool_bottom = -(rows - 1) * _ROW
    right = gpu_x + gpu_columns * (_block_width(size) + _COLUMN_GAP)
    if show_cpu and snapshot.num_cpu_blocks:
        cpu_columns = -(-snapshot.num_cpu_blocks // _pool_rows(snapshot.num_cpu_blocks, rows_per_column))
        right = cpu_x + cpu_columns * (_block_width(size) + _COLUMN_GAP)
    ax.set_xlim(-2.5, right + 1.5)
    ax.set_ylim(min(y_bottom, pool_bottom) - 0.8, _ROW * 1.4)
    ax.set_aspect("equal")
    ax.axis("off")
    _legend(ax, ["used", "shared", "cached", "copied"] if copied else ["used", "shared", "cached"])


def _draw_pool_blocks(ax, blocks: Sequence[BlockSnapshot], positions, device: str, size: int,
                      token_labels: TokenLabels, copied: set[int]) -> None:
    for block in blocks:
        x, y = positions[(device, block.block_number)]
        state = "copied" if block.block_number in copied else block_state(block)
        tokens = block.token_ids if state != "free" else ()
        _draw_slots(ax, x, y, size, tokens, COLORS[state], token_labels,
                    linewidth=2.0 if state == "shared" else 1.0)
        if block.cached and block.ref_count:  # registered in the prefix cache and in use
            ax.add_patch(Rectangle((x, y), _block_width(size), _CELL, fill=False,
                                   edgecolor=COLORS["cached"], linewidth=3.0))
        # Number and reference count stacked on the block's right: the gap to the next column
        # holds one label pair only (so "ref 1" never runs into the next block's "#8"), and the
        # left side stays free for the arrows from the logical blocks.
        right = x + _block_width(size) + 0.2
        ax.text(right, y + 0.72, f"#{block.block_number}", ha="left", va="center", fontsize=6.5)
        if block.ref_count:
            ax.text(right, y + 0.24, f"ref {block.ref_count}", ha="left",
                    va="center", fontsize=6.5, color=COLORS["shared"] if block.ref_count > 1 else COLORS["edge"],
                    fontweight="bold" if block.ref_count > 1 else "normal")


def _draw_sequences(ax, snapshot, seq_ids, tables, positions, token_labels, show_cpu) -> float:
    """Logical blocks of each sequence and arrows to their physical blocks; returns the lowest y."""
    size, y = snapshot.block_size, 0.0
    for row, seq_id in enumerate(seq_ids):
        y = -row * _ROW * 1.6
        color = request_color(seq_id)
        on_cpu = seq_id in snapshot.cpu_block_tables
        tokens = snapshot.seq_token_ids.get(seq_id, [])
        ax.text(-0.3, y + 0.5, f"seq {seq_id}", ha="right", va="center", fontsize=8, color=color,
                fontweight="bold")
        ax.text(0, y - 0.35, f"table {tables[seq_id]}" + ("  (swapped)" if on_cpu else ""),
                fontsize=7, va="center", color=COLORS["swapped"] if on_cpu else COLORS["edge"],
                bbox=dict(facecolor="white", edgecolor="none", pad=0.3))  # over the arrows

        for j, block_number in enumerate(tables[seq_id]):
            x = j * (_block_width(size) + _BLOCK_GAP)
            _draw_slots(ax, x, y, size, tokens[j * size:(j + 1) * size], _tint(color), token_labels,
                        edge=color)
            target = positions.get(("cpu" if on_cpu else "gpu", block_number))
            if target is None or (on_cpu and not show_cpu):
                continue
            # Straight from the block's top edge to a block above, its bottom edge to one below,
            # and beneath every block (zorder): an arrow never runs over its own row's tokens.
            start_y = y + _CELL if target[1] > y else y
            ax.add_patch(FancyArrowPatch((x + _block_width(size) * 0.75, start_y), (target[0] - 0.1, target[1] + 0.5),
                                         arrowstyle="-|>", mutation_scale=8, color=color, alpha=0.7,
                                         linewidth=1.0, zorder=0.5))
    return y - 0.6


# ======================================================================= pools
def draw_block_pool(snapshot: BlockManagerSnapshot, ax, *, device: str = "gpu",
                    token_labels: TokenLabels = None, copied: Collection[int] = (),
                    rows_per_column: int = _ROWS_PER_COLUMN) -> None:
    """One device's physical blocks, coloured by state, with tokens and reference counts."""
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}.")
    blocks = snapshot.gpu_blocks if device == "gpu" else snapshot.cpu_blocks
    size = snapshot.block_size
    rows = _pool_rows(len(blocks), rows_per_column)
    positions = {(device, b.block_number): _pool_position(b.block_number, 0.0, size, rows) for b in blocks}
    _draw_pool_blocks(ax, blocks, positions, device, size, token_labels, set(copied))
    columns = max(1, -(-len(blocks) // rows))
    ax.set_xlim(-1.5, columns * (_block_width(size) + _COLUMN_GAP) + 0.5)
    ax.set_ylim(-(rows - 1) * _ROW - 0.5, _ROW)
    ax.set_title(f"{device.upper()} pool: {len(blocks)} blocks of {size} slots", fontsize=9,
                 color=COLORS[device])
    ax.set_aspect("equal")
    ax.axis("off")


def draw_free_lists(snapshot: BlockManagerSnapshot, ax) -> None:
    """The GPU free list (handed out left to right) and the evictable cached blocks (evicted
    left to right: least recently used first), plus the CPU free list."""
    lanes = [("GPU free", snapshot.free_gpu_block_ids, COLORS["free"]),
             ("GPU cached (LRU)", snapshot.cached_gpu_block_ids, COLORS["cached"]),
             ("CPU free", snapshot.free_cpu_block_ids, COLORS["free"])]
    width = max([len(ids) for _, ids, _ in lanes] + [8])
    for lane, (name, ids, face) in enumerate(lanes):
        y = -lane * 1.3
        ax.text(-0.3, y + 0.5, f"{name} ({len(ids)})", ha="right", va="center", fontsize=8)
        for i, block_number in enumerate(ids):
            ax.add_patch(Rectangle((i, y), 0.9, 0.9, facecolor=face, edgecolor=COLORS["edge"]))
            ax.text(i + 0.45, y + 0.45, str(block_number), ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(-len(lanes) * 1.3 + 0.8, 1.2)
    ax.axis("off")


def draw_ref_counts(snapshot: BlockManagerSnapshot, ax, *, device: str = "gpu") -> None:
    """A bar per physical block: its reference count, coloured by state (free blocks at 0)."""
    blocks = snapshot.gpu_blocks if device == "gpu" else snapshot.cpu_blocks
    numbers = [b.block_number for b in blocks]
    colors = [COLORS[block_state(b)] for b in blocks]
    ax.bar(numbers, [b.ref_count for b in blocks], color=colors, edgecolor=COLORS["edge"])
    ax.set_xticks(numbers)
    ax.set_xlabel(f"{device.upper()} block number")
    ax.set_ylabel("ref_count")
    top = max([b.ref_count for b in blocks] + [1])
    ax.set_ylim(0, top + 0.5)
    ax.set_yticks(range(top + 1))


def draw_hash_chain(snapshot: BlockManagerSnapshot, seq_id: int, ax, *,
                    token_labels: TokenLabels = None) -> None:
    """One sequence's blocks with the chained hash of each full, computed block.

    hash(block i) = hash(hash(block i-1), tokens of block i), so a block's hash names its
    whole prefix. Yellow = registered in the prefix cache (reusable by a later request).
    """
    size = snapshot.block_size
    table = snapshot.gpu_block_tables.get(seq_id) or snapshot.cpu_block_tables[seq_id]
    pool = snapshot.gpu_blocks if seq_id in snapshot.gpu_block_tables else snapshot.cpu_blocks
    tokens = snapshot.seq_token_ids[seq_id]
    step = _block_width(size) + 2.0
    for j, block_number in enumerate(table):
        block = pool[block_number]
        x = j * step
        face = COLORS["cached"] if block.cached else request_color(seq_id) + "55"
        _draw_slots(ax, x, 0.0, size, tokens[j * size:(j + 1) * size], face, token_labels)
        ax.text(x + _block_width(size) / 2, -0.45, f"#{block_number}  h={short_hash(block.block_hash)}",
                ha="center", va="center", fontsize=7)
        if j > 0:
            ax.add_patch(FancyArrowPatch((x - 2.0 + 0.1, 0.5), (x - 0.1, 0.5), arrowstyle="-|>",
                                         mutation_scale=8, color=COLORS["edge"]))
    ax.text(0, 1.5, f"seq {seq_id}: parent hash -> block hash", fontsize=9, fontweight="bold")
    ax.set_xlim(-0.5, max(1, len(table)) * step)
    ax.set_ylim(-1.0, 2.0)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_block_usage(snapshots: Sequence[BlockManagerSnapshot], ax, *, show_hit_rate: bool = True) -> None:
    """Stacked GPU blocks over a trace (referenced / cached / free) and the prefix-cache hit rate."""
    steps = range(len(snapshots))
    free = [len(s.free_gpu_block_ids) for s in snapshots]
    cached = [len(s.cached_gpu_block_ids) for s in snapshots]
    used = [s.num_gpu_blocks - f - c for s, f, c in zip(snapshots, free, cached)]
    ax.stackplot(steps, used, cached, free, labels=["referenced", "cached", "free"],
                 colors=[COLORS["used"], COLORS["cached"], COLORS["idle"]])
    ax.set_xlabel("step")
    ax.set_ylabel("GPU blocks")
    ax.set_ylim(0, max([s.num_gpu_blocks for s in snapshots] + [1]))
    handles, labels = ax.get_legend_handles_labels()
    if show_hit_rate and snapshots and snapshots[-1].prefix_cache_hit_rate >= 0:
        twin = ax.twinx()
        line = twin.plot(steps, [max(0.0, s.prefix_cache_hit_rate) for s in snapshots],
                         color=COLORS["edge"], linewidth=2, label="hit rate")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("prefix-cache hit rate")
        handles, labels = handles + line, labels + ["hit rate"]
    ax.legend(handles, labels, loc="upper left", fontsize=8)
