"""The n-gram proposer ("prompt lookup decoding"): `NGramWorker`.

Mirrors `vllm/spec_decode/ngram_worker.py`. No model: for each sequence take its last n
tokens (n from `ngram_prompt_lookup_max` down to `ngram_prompt_lookup_min`), find the latest
earlier place where those n tokens occur in the sequence (prompt and output), and propose
the k tokens that followed them there:

    tokens   ... the cat sat on the mat . the cat      (last n=2: "the cat")
    match        ^^^^^^^                               -> propose "sat on the" (k=3)

It pays off when the output repeats its input: editing or summarising a given text, code
completion, a model quoting its prompt. The proposals are deterministic (q is one-hot), and
there may be fewer than k, or none (no match: the sequence decodes plainly this step).

Differences from vLLM: the latest match, not the first (recent context is likelier to
continue the same way); the search runs on the host with numpy, not on the device.
"""

from __future__ import annotations

import numpy as np

from minivllm.config import SpeculativeConfig
from minivllm.sequence import ExecuteModelRequest, SequenceGroupMetadata
from minivllm.spec_decode.util import Proposals


def ngram_lookup(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` (n_max >= n >= n_min tokens) that occurs earlier; [] if none does.

    >>> ngram_lookup([5, 6, 7, 8, 5, 6], k=2, n_min=1, n_max=3)
    [7, 8]
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    last = len(tokens) - 1
    # Earlier places equal to the last token, each with a token after it: where a match ends.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    # How many tokens each match covers, reading backwards from its end (up to n_max).
    match_len = np.ones_like(ends)
    extends = np.ones(len(ends), dtype=bool)
    for back in range(1, min(n_max, last)):
        extends &= (ends >= back) & (tokens[np.maximum(ends - back, 0)] == tokens[last - back])
        match_len += extends
    for n in range(n_max, n_min - 1, -1):
        hits = ends[match_len >= n]
        if len(hits):
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


class NGramWorker:
    """A proposer with no model and no KV cache (the other proposer methods are no-ops)."""

    def __init__(self, speculative_config: SpeculativeConfig) -> None:
        self.n_min = speculative_config.ngram_prompt_lookup_min
        self.n_max = speculative_config.ngram_prompt_lookup_max

    def load_model(self) -> None:
        pass

    def get_cache_block_size_bytes(self) -> int:
        return 0

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def apply_block_moves(self, req: ExecuteModelRequest) -> None:
        pass

    def run_prefill(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> None:
        pass

    def propose(self, seq_group_metadata_list: list[SequenceGroupMetadata], num_proposals: list[int]) -> Proposals:
        """Proposals for the groups with `num_proposals` > 0 (one sequence each), in order."""
        k = max(num_proposals, default=0)
        rows = []
        for metadata, wanted in zip(seq_group_metadata_list, num_proposals):
            if wanted:
                (data,) = metadata.seq_data.values()
                rows.append(ngram_lookup(data.get_token_ids(), wanted, self.n_min, self.n_max))
        return Proposals([row + [0] * (k - len(row)) for row in rows], [len(row) for row in rows], probs=None)
