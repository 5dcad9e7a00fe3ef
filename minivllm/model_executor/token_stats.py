"""The penalties' token statistics of each sequence: `TokenStatsCache`, which keeps them on
the device between steps, and `token_counts`, the same statistics counted from scratch.

vLLM v0 counts them from the token lists every step (`SamplingTensors.from_lists`), a host
pass over every token of the batch (~250k at 256 requests of 1,000 tokens). Here a request's
prompt is read once, and each step adds only the output tokens new since its last step.
"""

from __future__ import annotations

import torch

from minivllm.attention.metadata import to_device
from minivllm.model_executor.sampling_metadata import SequenceGroupToSample


class TokenStatsCache:
    """Per sequence, one row of a pool: which tokens its prompt holds (`[vocab]` bool) and how
    often each appears in its output (`[vocab]` fp32). The pool doubles when full and never
    shrinks: it keeps the most sequences with penalties that ran at once (5 bytes per vocabulary
    entry each: 0.76 MB for Qwen3's 151,936 tokens).
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, device=device)
        self.slots: dict[tuple[str, int], int] = {}  # (request id, sequence id) -> its pool row
        self.num_counted: dict[tuple[str, int], int] = {}  # ... -> output tokens already counted
        self.free_slots: list[int] = []

    def rows(self, rows: list[tuple[SequenceGroupToSample, int]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[rows, vocab]` prompt masks and output counts of these (group, sequence id) rows
        (copies: a multi-step run may add to its counts without touching the pool)."""
        prompt_rows, prompt_tokens, count_rows, count_tokens = [], [], [], []
        for group, seq_id in rows:
            key, data = (group.request_id, seq_id), group.seq_data[seq_id]
            if key not in self.slots:
                slot = self._allocate(key)
                prompt_rows += [slot] * data.get_prompt_len()
                prompt_tokens += data.prompt_token_ids
            slot, start = self.slots[key], self.num_counted[key]
            new_tokens = data.output_token_ids[start:]
            count_rows += [slot] * len(new_tokens)
            count_tokens += new_tokens
            self.num_counted[key] = start + len(new_tokens)
        if prompt_tokens:
            self.prompt_mask[self._index(prompt_rows), self._index(prompt_tokens)] = True
        if count_tokens:
            ones = torch.ones(len(count_tokens), device=self.device)
            index = (self._index(count_rows), self._index(count_tokens))
            self.output_counts.index_put_(index, ones, accumulate=True)
        slots = self._index([self.slots[(group.request_id, seq_id)] for group, seq_id in rows])
        return self.prompt_mask[slots], self.output_counts[slots]

    def release(self, request_ids: list[str]) -> None:
        """Give back the rows of (every sequence of) requests that ended."""
        ended = set(request_ids)
        self._free([key for key in self.slots if key[0] in ended])

    def release_dropped_sequences(self, request_id: str, live_seq_ids: set[int]) -> None:
        """Give back the rows of a running request's sequences that are gone (beam search
        replaces its beams by new sequences every step; the request itself runs on)."""
        dropped = [key for key in self.slots if key[0] == request_id and key[1] not in live_seq_ids]
        self._free(dropped)

    def _free(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            self.free_slots.append(self.slots.pop(key))
            del self.num_counted[key]

    def _allocate(self, key: tuple[str, int]) -> int:
        if not self.free_slots:  # grow the pool: double it (rows are copied once per doubling)
            old = self.prompt_mask.shape[0]
            new = max(2 * old, 16)
            more = (new - old, self.vocab_size)
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(more)])
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(more)])
            self.free_slots = list(range(new - 1, old - 1, -1))
        slot = self.free_slots.pop()
        self.prompt_mask[slot] = False
        self.output_counts[slot] = 0
        self.slots[key], self.num_counted[key] = slot, 0
        return slot

    def _index(self, values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), self.device)


def token_counts(token_lists: list, vocab_size: int, device) -> torch.Tensor:
    """`[rows, vocab_size]` fp32 counts of each token id in each row's list: one padded copy
    to the device and one scatter (padding goes to an extra column that is dropped)."""
    max_len = max((len(tokens) for tokens in token_lists), default=0)
    padded = torch.full((len(token_lists), max(max_len, 1)), vocab_size, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    padded = to_device(padded, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size].contiguous()
