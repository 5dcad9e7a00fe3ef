"""Pictures of PagedAttention: block tables, the paged cache, attention masks, split-KV.

Pure drawing functions (state in, a matplotlib Axes out), taking plain Python lists, so they
need neither torch nor triton:

    draw_block_tables(ax, block_tables, seq_lens, block_size)    logical blocks -> physical
    draw_paged_cache(ax, block_tables, seq_lens, block_size, num_blocks)   where each token lives
    draw_attention_mask(ax, context_len, query_len)              who sees whom in paged prefill
    draw_split_kv(ax, seq_lens, num_splits, tile_tokens)         which program reads which keys

    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> draw_paged_cache(ax, [[2, 0]], [5], block_size=4, num_blocks=3)
    >>> plt.close(fig)
"""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.viz.style import COLORS, REQUEST_PALETTE, request_color

_CELL = 1.0  # one token slot is a unit square
_BLOCK_GAP = 0.35  # space between two blocks of a row
_FONT = 8  # readable at 100 dpi in notebooks 10 and 11


def slot_owners(
    block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int
) -> dict[int, tuple[int, int]]:
    """slot -> (sequence, token) for every cached token, by the contract's slot formula.

    >>> slot_owners([[2, 0]], [5], block_size=4)[0]   # token 4 is in logical block 1 = block 0
    (0, 4)
    """
    owners = {}
    for seq, (table, seq_len) in enumerate(zip(block_tables, seq_lens)):
        if len(table) * block_size < seq_len:
            raise ValueError(f"sequence {seq}: {len(table)} blocks cannot hold {seq_len} tokens")
        for token in range(seq_len):
            slot = table[token // block_size] * block_size + token % block_size
            owners[slot] = (seq, token)
    return owners


def _draw_slot(ax, x, y, color, text=None):
    ax.add_patch(_rectangle(x, y, color))
    if text is not None:
        ax.text(x + _CELL / 2, y + _CELL / 2, text, ha="center", va="center", fontsize=_FONT)


def _rectangle(x, y, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), _CELL, _CELL, facecolor=color, edgecolor=COLORS["edge"], linewidth=0.6)


def draw_paged_cache(ax, block_tables, seq_lens, block_size: int, num_blocks: int,
                     blocks_per_row: int = 6) -> None:
    """The physical cache: `num_blocks` blocks of `block_size` slots, each token in its owner's colour.

    A slot shows the token index it holds; free slots are white. Blocks are laid out
    `blocks_per_row` to a row, block 0 top left, labelled with their physical number.
    """
    owners = slot_owners(block_tables, seq_lens, block_size)
    block_width = block_size * _CELL + _BLOCK_GAP
    num_rows = -(-num_blocks // blocks_per_row)
    for block in range(num_blocks):
        x0 = (block % blocks_per_row) * block_width
        y0 = (num_rows - 1 - block // blocks_per_row) * 1.8
        ax.text(x0 + block_size * _CELL / 2, y0 + 1.25, f"block {block}", ha="center", fontsize=_FONT)
        for offset in range(block_size):
            owner = owners.get(block * block_size + offset)
            color = COLORS["free"] if owner is None else request_color(owner[0])
            _draw_slot(ax, x0 + offset * _CELL, y0, color, None if owner is None else str(owner[1]))
    for seq in range(len(seq_lens)):
        ax.plot([], [], "s", color=request_color(seq), label=f"seq {seq}")
    ax.legend(fontsize=_FONT, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_xlim(-0.2, blocks_per_row * block_width)
    ax.set_ylim(-0.3, num_rows * 1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("physical KV cache (number = token position)", fontsize=9)


def draw_block_tables(ax, block_tables, seq_lens, block_size: int) -> None:
    """Each sequence's logical blocks in order, labelled with the physical block they map to."""
    block_width = block_size * _CELL + _BLOCK_GAP
    num_seqs = len(seq_lens)
    for seq, (table, seq_len) in enumerate(zip(block_tables, seq_lens)):
        y = (num_seqs - 1 - seq) * 1.6
        ax.text(-0.4, y + 0.5, f"seq {seq}", ha="right", va="center", fontsize=_FONT + 1)
        for logical in range(-(-seq_len // block_size)):
            x0 = logical * block_width
            for offset in range(block_size):
                token = logical * block_size + offset
                filled = token < seq_len
                color = request_color(seq) if filled else COLORS["free"]
                _draw_slot(ax, x0 + offset * _CELL, y, color, str(token) if filled else None)
            ax.text(x0 + block_size * _CELL / 2, y + 1.15, f"→ block {table[logical]}",
                    ha="center", fontsize=_FONT)
    longest = max(-(-n // block_size) for n in seq_lens)
    ax.set_xlim(-2.5, longest * block_width)
    ax.set_ylim(-0.3, num_seqs * 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("logical blocks (block table entry above each)", fontsize=9)


def draw_attention_mask(ax, context_len: int, query_len: int) -> None:
    """Which keys (columns) each new token (rows) attends to in paged prefill.

    New token i sits at position context_len + i and sees keys 0 .. context_len + i: all of the
    cached context (one colour), then causally the new tokens (another colour).
    """
    seq_len = context_len + query_len
    for i in range(query_len):
        for j in range(seq_len):
            if j < context_len:
                color = COLORS["cached"]
            elif j <= context_len + i:
                color = COLORS["prompt"]
            else:
                color = COLORS["idle"]
            ax.add_patch(_rectangle(j, query_len - 1 - i, color))
    ax.set_xlim(0, seq_len)
    ax.set_ylim(0, query_len)
    ax.set_aspect("equal")
    ax.set_xticks([k + 0.5 for k in range(seq_len)], [str(k) for k in range(seq_len)], fontsize=_FONT)
    ax.set_yticks([query_len - 0.5 - i for i in range(query_len)],
                  [f"new {i} (pos {context_len + i})" for i in range(query_len)], fontsize=_FONT)
    ax.set_xlabel("key position (read from the paged cache)", fontsize=8)
    for name, color in [("cached context", COLORS["cached"]), ("new tokens, causal", COLORS["prompt"]),
                        ("masked", COLORS["idle"])]:
        ax.plot([], [], "s", color=color, label=name)
    ax.legend(fontsize=_FONT, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(f"prefill mask: context {context_len}, {query_len} new tokens", fontsize=9)


def split_ranges(seq_len: int, num_splits: int, tile_tokens: int) -> list[tuple[int, int]]:
    """The token ranges the split-KV kernel's programs read for one sequence (empty ones dropped).

    Same arithmetic as `_split_len` in kernels/paged_attention.py: seq_len / num_splits,
    rounded up to whole tiles, so a short sequence uses fewer splits.

    >>> split_ranges(100, num_splits=4, tile_tokens=16)
    [(0, 32), (32, 64), (64, 96), (96, 100)]
    >>> split_ranges(20, num_splits=4, tile_tokens=16)
    [(0, 16), (16, 20)]
    """
    split_len = -(-(-(-seq_len // num_splits)) // tile_tokens) * tile_tokens
    return [(start, min(start + split_len, seq_len)) for start in range(0, seq_len, split_len)]


def draw_split_kv(ax, seq_lens: Sequence[int], num_splits: int, tile_tokens: int) -> None:
    """One bar per sequence: its context cut into the splits that separate programs read.

    Thin ticks mark the tiles each program loads per loop iteration. With num_splits = 1 this is
    the one-pass (v1) kernel: one program walks the whole context.
    """
    for seq, seq_len in enumerate(seq_lens):
        y = len(seq_lens) - 1 - seq
        for split, (start, end) in enumerate(split_ranges(seq_len, num_splits, tile_tokens)):
            ax.barh(y, end - start, left=start, height=0.6, color=REQUEST_PALETTE[split % len(REQUEST_PALETTE)],
                    edgecolor=COLORS["edge"], linewidth=0.6)
            ax.text((start + end) / 2, y, f"p{split}", ha="center", va="center", fontsize=_FONT, color="white")
            for tick in range(start + tile_tokens, end, tile_tokens):
                ax.plot([tick, tick], [y - 0.3, y + 0.3], color="white", linewidth=0.5)
    ax.set_yticks(range(len(seq_lens)), [f"seq {s} ({n} tok)" for s, n in reversed(list(enumerate(seq_lens)))],
                  fontsize=_FONT + 1)
    ax.set_xlabel("key position", fontsize=8)
    kind = "v1: one program per (seq, KV head)" if num_splits == 1 else f"v2: up to {num_splits} splits"
    ax.set_title(f"{kind}, tiles of {tile_tokens} tokens", fontsize=9)
