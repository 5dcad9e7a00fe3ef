"""What the attention layers know of one flattened batch (vLLM v0's `AttentionMetadata`).

A step's tokens lie back to back, prefill chunks first, then one token per decode:

    tokens:  [ p0 p0 p0 p0 | p1 p1 | d2 | d3 | d4 ]     num_prefills=2, num_prefill_tokens=6
    seqs:       seq 0        seq 1   seq 2 ...           num_decode_tokens=3

Built once per step by the model runner and passed down to every layer, never a global.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

from minivllm.attention.packed_copy import to_device_together


@dataclass
class AttentionMetadata:
    """One batch's layout. Shapes (num_seqs = prefills + decodes):

    slot_mapping     [num_tokens] int64   cache slot each new token's key/value is written to
                                          (-1 = do not write, e.g. padding)
    seq_lens         [num_seqs] int32     context + new tokens of each sequence
    query_start_loc  [num_seqs + 1] int32 cumulative new-token counts: sequence i's tokens are
                                          rows query_start_loc[i]:query_start_loc[i+1]
    block_tables     [num_seqs, max_blocks] int32  physical block numbers, row per sequence
    max_query_len, max_seq_len            python ints (vLLM's fields): the longest query and sequence,
                                          known on the host with no device read
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def __post_init__(self) -> None:
        expected = {"slot_mapping": (self.num_tokens,), "seq_lens": (self.num_seqs,),
                    "query_start_loc": (self.num_seqs + 1,)}
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"{name} must have shape {shape} ({self.num_prefills} prefills, "
                                 f"{self.num_decode_tokens} decodes), got {got}.")

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decode_tokens  # a decode is one token

    # The two halves are views (no copies), built once per step and shared by every layer.
    @cached_property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """The prefill sequences alone (None if there are none)."""
        if self.num_prefills == 0:
            return None
        if self.num_decode_tokens == 0:
            return self
        n, t = self.num_prefills, self.num_prefill_tokens
        return replace(
            self, num_decode_tokens=0, slot_mapping=self.slot_mapping[:t], seq_lens=self.seq_lens[:n],
            query_start_loc=self.query_start_loc[: n + 1], block_tables=self.block_tables[:n])

    @cached_property
    def decode_metadata(self) -> AttentionMetadata | None:
        """The decode sequences alone (None if there are none); query_start_loc restarts at 0."""
        if self.num_decode_tokens == 0:
            return None
        if self.num_prefills == 0:
            return self  # no new tensors: a captured CUDA graph keeps reading the same buffers
        n, t = self.num_prefills, self.num_prefill_tokens
        return replace(
            self, num_prefills=0, num_prefill_tokens=0, slot_mapping=self.slot_mapping[t:],
            seq_lens=self.seq_lens[n:], query_start_loc=self.query_start_loc[n:] - t,
            block_tables=self.block_tables[n:], max_query_len=1)


def slot_of(block_number, position, block_size: int):
    """The cache slot of the token at `position` in block `block_number` (its block table's
    entry `position // block_size`); ints or tensors (the multi-step runner's `advance_step`)."""
    return block_number * block_size + position % block_size


def build_attn_metadata(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                        num_prefills: int, block_size: int,
                        device: torch.device | str = "cpu") -> AttentionMetadata:
    """The metadata from python lists, one entry per sequence (prefills first).

    block_tables[i]  physical blocks of sequence i, enough for context + new tokens
    context_lens[i]  tokens of sequence i already in the cache (cached prefix, earlier chunks)
    query_lens[i]    new tokens of sequence i in this step (1 for a decode)

    Example (block_size=4): 5 cached tokens and 2 new ones in blocks [7, 2]
    -> slot_mapping [2*4+1, 2*4+2] = [9, 10], seq_lens [7], query_start_loc [0, 2].
    """
    if not len(block_tables) == len(context_lens) == len(query_lens):
        raise ValueError("block_tables, context_lens and query_lens need one entry per sequence.")
    if any(q != 1 for q in query_lens[num_prefills:]):
        raise ValueError(f"prefills come first: after the first {num_prefills} sequences, decodes of 1 new token each.")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    for table, seq_len in zip(block_tables, seq_lens):
        if len(table) * block_size < seq_len:
            raise ValueError(f"block table {table} holds {len(table) * block_size} tokens, fewer than {seq_len}.")
    query_start_loc = list(itertools.accumulate(query_lens, initial=0))
    padded = pad_block_tables(block_tables)
    seq = np.repeat(np.arange(len(query_lens)), query_lens)  # [num_tokens] each token's sequence
    shift = np.array([c - s for c, s in zip(context_lens, query_start_loc)], dtype=np.int64)
    positions = np.arange(len(seq)) + shift[seq]  # row query_start_loc[i] + t -> position context_lens[i] + t
    slot_mapping = slot_of(padded.numpy()[seq, positions // block_size].astype(np.int64), positions, block_size)
    slots, lens, starts, tables = to_device_together([  # one copy to a GPU
        torch.from_numpy(slot_mapping), torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(query_start_loc, dtype=torch.int32), padded], device)
    return AttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=sum(query_lens[:num_prefills]),
        num_decode_tokens=len(query_lens) - num_prefills, slot_mapping=slots, seq_lens=lens,
        query_start_loc=starts, block_tables=tables,
        max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
    )


def pad_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """`[num_seqs, max_blocks]` int32, rows padded with block 0 (never read past seq_len).
    One numpy scatter: 256 decodes of 4k tokens hold 65k block numbers, too many for a loop."""
    lengths = np.array([len(t) for t in block_tables], dtype=np.int64)
    max_blocks = int(lengths.max(initial=0))
    padded = np.zeros((len(block_tables), max_blocks), dtype=np.int32)
    padded[np.arange(max_blocks) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    return torch.from_numpy(padded)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; through pinned memory on a GPU, so the copy is asynchronous."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
