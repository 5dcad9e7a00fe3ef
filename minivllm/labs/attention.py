"""The checks of labs 04 and 05: a learner's PagedAttention ops against dense softmax attention,
then inside a real `LLM` as an attention backend (`minivllm.kernels.register_backend`).

A case is a paged KV cache built the way the engine builds one: each sequence's true keys and
values `[seq_len, num_kv_heads, head_dim]` written through a block table of shuffled block ids,
the last block partly filled, and every slot that no token owns set to NaN, so an op that reads
one returns NaN. The expected output is dense softmax attention over the true, contiguous K/V
in fp64 (`dense_attention`). A check stops at the first case off by more than `ATOL`, naming
the case, the sequence, the max error and, when the output is that of a known mistake (no
scale, no causal mask, the wrong KV head), the mistake. The ops' contract is that of
`minivllm.kernels.reference` (vLLM 0.6's `vllm/attention/ops/paged_attn.py` and
`csrc/attention/attention_kernels.cu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from minivllm.kernels import get_ops
from minivllm.labs import LabCheckFailed, expect, expect_tensor, passed
from minivllm.labs.parity import PROMPTS, assert_greedy_matches_transformers
from minivllm.viz.device import DEVICE

ATOL = 1e-4  # fp32 ops against the fp64 reference, on values of about unit size


@dataclass(frozen=True)
class PagedCase:
    """Sequence i holds seq_lens[i] tokens, the last query_lens[i] of them new this step
    (a decode step: 1), the others its cached context."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    seed: int


DECODE_CASES = (
    PagedCase("one sequence of one token, 2 heads", 2, 2, 8, 4, (1,), (1,), 0),
    PagedCase("3 sequences, GQA (2 query heads per KV head)", 4, 2, 8, 4, (5, 9, 3), (1, 1, 1), 1),
    PagedCase("full and partial last blocks, GQA group 4", 8, 2, 16, 16, (16, 1, 33), (1, 1, 1), 2),
    PagedCase("multi-query (1 KV head), head_dim 64", 4, 1, 64, 8, (7, 40), (1, 1), 3),
    PagedCase("the bundled model's layer shape", 8, 2, 32, 16, (20, 48, 3, 17), (1, 1, 1, 1), 4),
)
PREFILL_CASES = (
    PagedCase("one fresh prompt, 2 heads", 2, 2, 8, 4, (6,), (6,), 10),
    PagedCase("2 fresh prompts, GQA group 2", 4, 2, 8, 4, (5, 9), (5, 9), 11),
    PagedCase("chunks over a cached context (chunked prefill)", 4, 2, 16, 4, (9, 13), (5, 3), 12),
    PagedCase("a prefix-cache hit of whole blocks, GQA group 4", 8, 2, 16, 8, (20, 11), (4, 11), 13),
    PagedCase("a 1-token chunk, a fresh prompt and a long chunk, 1 KV head", 4, 1, 32, 16, (17, 6, 40),
              (1, 6, 24), 14),
)


@dataclass
class PagedBatch:
    """One case's tensors, as the attention layer hands them to the ops."""

    case: PagedCase
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], sequence i's rows at query_start_loc[i]:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where no token is
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float
    keys: list[torch.Tensor]  # sequence i's true keys [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    tables: list[list[int]]  # sequence i's physical blocks, in logical order

    def sequence(self, i: int) -> PagedBatch:
        """Sequence i alone, as a batch of one."""
        start, end = self.query_start_loc[i:i + 2].tolist()
        return PagedBatch(self.case, self.query[start:end], self.key_cache, self.value_cache,
                          self.block_tables[i:i + 1], self.seq_lens[i:i + 1],
                          torch.tensor([0, end - start], dtype=torch.int32), self.scale, self.keys[i:i + 1],
                          self.values[i:i + 1], self.tables[i:i + 1])


def build_batch(case: PagedCase, device: str | torch.device = "cpu") -> PagedBatch:
    """`case`'s paged cache, queries and metadata, fp32 on `device` (seeded: the same every time)."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, kv_heads, dim = case.block_size, case.num_kv_heads, case.head_dim
    blocks_per_seq = [-(-n // bs) for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN: reading one shows
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled: a table is not a range
    tables = [[order.pop() for _ in range(k)] for k in blocks_per_seq]
    key_cache = torch.full((num_blocks, bs, kv_heads, dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    keys = [torch.randn(n, kv_heads, dim, generator=gen) for n in case.seq_lens]
    values = [torch.randn(n, kv_heads, dim, generator=gen) for n in case.seq_lens]
    for table, k, v in zip(tables, keys, values):
        for t in range(len(k)):
            key_cache[table[t // bs], t % bs] = k[t]
            value_cache[table[t // bs], t % bs] = v[t]
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(sum(case.query_lens), case.num_heads, dim, generator=gen)
    starts = torch.tensor([0, *case.query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    to = dict(device=device)
    return PagedBatch(case, query.to(**to), key_cache.to(**to), value_cache.to(**to), block_tables.to(**to),
                      torch.tensor(case.seq_lens, dtype=torch.int32, device=device), starts.to(**to),
                      dim ** -0.5, [k.to(**to) for k in keys], [v.to(**to) for v in values], tables)


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    num_context: int, *, causal: bool = True, gqa: str = "div") -> torch.Tensor:
    """fp64 softmax attention of query `[query_len, num_heads, D]` over contiguous keys, values
    `[seq_len, num_kv_heads, D]`: query i sits at position num_context + i and sees keys
    0 .. num_context + i (all if not causal); query head h reads KV head h // group
    (gqa="mod": h % num_kv_heads, a known mistake)."""
    num_heads, num_kv_heads = query.shape[1], keys.shape[1]
    heads = torch.arange(num_heads, device=query.device)
    kv_head = heads // (num_heads // num_kv_heads) if gqa == "div" else heads % num_kv_heads
    k, v = keys.double()[:, kv_head], values.double()[:, kv_head]  # [seq_len, num_heads, D]
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if causal:
        query_pos = num_context + torch.arange(query.shape[0], device=query.device)
        visible = torch.arange(keys.shape[0], device=query.device)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


# Outputs a wrong op is likely to give: the reference's arguments changed the way the mistake does.
MISTAKES = (
    ("the softmax scale is missing: scores are (q . k) x scale", dict(scale=1.0)),
    ("there is no causal mask: a new token must not see the new tokens after it", dict(causal=False)),
    ("the causal mask ignores the cached context: new token i sees keys 0 .. num_context + i, not 0 .. i",
     dict(num_context=0)),
    ("query head h reads KV head h % num_kv_heads; with GQA it reads KV head h // (num_heads // num_kv_heads)",
     dict(gqa="mod")),
)


def expected_output(batch: PagedBatch, **mistake) -> torch.Tensor:
    """`[num_tokens, num_heads, head_dim]` fp64: dense attention of every sequence of `batch`
    (with one of `MISTAKES`' changes, if given)."""
    outs = []
    starts = batch.query_start_loc.tolist()
    for i, (keys, values) in enumerate(zip(batch.keys, batch.values)):
        query = batch.query[starts[i]:starts[i + 1]]
        kwargs = dict(scale=batch.scale, num_context=len(keys) - len(query)) | mistake
        outs.append(dense_attention(query, keys, values, **kwargs))
    return torch.cat(outs)


def check_gather_kv(gather_kv: Callable) -> None:
    """`gather_kv(key_cache, value_cache, block_table, seq_len)` -> (keys, values), each
    `[seq_len, num_kv_heads, head_dim]`: sequence's tokens in order, read through its block table."""
    for case in DECODE_CASES + PREFILL_CASES:
        batch = build_batch(case)
        for i, (table, n) in enumerate(zip(batch.tables, case.seq_lens)):
            where = f"case '{case.name}', sequence {i} ({n} tokens, block_size {case.block_size}, block table {table})"
            got = gather_kv(batch.key_cache, batch.value_cache, batch.block_tables[i], n)
            expect(isinstance(got, (tuple, list)) and len(got) == 2,
                   f"{where}: gather_kv returned {type(got).__name__}, expected a pair (keys, values)")
            for what, tensor, true in zip(("keys", "values"), got, (batch.keys[i], batch.values[i])):
                expect_tensor(tensor, true.shape, what=f"{where}: gather_kv's {what} ([seq_len, num_kv_heads, head_dim])")
                t = next((t for t in range(n) if not torch.equal(tensor[t], true[t])), None)
                if t is not None:
                    raise LabCheckFailed(
                        f"{where}: token {t}'s {what} are wrong. Token t lives in logical block t // block_size "
                        f"= {t // case.block_size}, that is physical block {table[t // case.block_size]}, at "
                        f"offset t % block_size = {t % case.block_size}")
    passed("gather_kv: every token of every sequence read through its block table")


def check_attention(attention: Callable) -> None:
    """`attention(query, keys, values, scale, num_context)` over contiguous K/V, as `dense_attention`."""
    for case in PREFILL_CASES + DECODE_CASES:
        batch = build_batch(case)
        starts = batch.query_start_loc.tolist()
        for i, (keys, values) in enumerate(zip(batch.keys, batch.values)):
            query = batch.query[starts[i]:starts[i + 1]]
            num_context = len(keys) - len(query)
            got = attention(query, keys, values, batch.scale, num_context)
            where = (f"case '{case.name}', sequence {i} ({num_context} cached tokens + {len(query)} new, "
                     f"{case.num_heads} query heads, {case.num_kv_heads} KV heads)")
            _compare(got, batch.sequence(i), where)
    passed("attention: every case equals dense softmax attention (scale, causal mask, GQA)")


def check_paged_prefill(paged_prefill_attention: Callable, device: str | torch.device = DEVICE) -> None:
    """`paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
    seq_lens, scale)` as `minivllm.kernels.reference.paged_prefill_attention`."""
    for case in PREFILL_CASES:
        batch = build_batch(case, device)
        got = paged_prefill_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                      batch.query_start_loc, batch.seq_lens, batch.scale)
        _compare(got, batch, f"case '{case.name}' (seq_lens {list(case.seq_lens)}, new tokens "
                              f"{list(case.query_lens)}, block_size {case.block_size})")
    passed(f"paged_prefill_attention: {len(PREFILL_CASES)} batches equal dense attention over the true K/V")


def check_paged_decode(paged_attention_decode: Callable, device: str | torch.device = DEVICE) -> None:
    """`paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)` as
    `minivllm.kernels.reference.paged_attention_decode`."""
    for case in DECODE_CASES:
        batch = build_batch(case, device)
        got = paged_attention_decode(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                     batch.seq_lens, batch.scale)
        _compare(got, batch, f"case '{case.name}' (seq_lens {list(case.seq_lens)}, block_size "
                              f"{case.block_size})")
    passed(f"paged_attention_decode: {len(DECODE_CASES)} batches equal dense attention over the true K/V")


def _compare(got: torch.Tensor, batch: PagedBatch, where: str) -> None:
    """LabCheckFailed naming the first wrong sequence of `batch`, the error and the likely mistake."""
    expect_tensor(got, batch.query.shape, batch.query.dtype,
                  what=f"{where}: your op (its output is shaped and typed like the query)")
    expected = expected_output(batch)
    error = (got.double() - expected).abs()
    if not got.isnan().any() and error.max().item() <= ATOL:
        return
    starts = batch.query_start_loc.tolist()
    seq = next(i for i in range(len(starts) - 1)
               if not (error[starts[i]:starts[i + 1]] <= ATOL).all())  # NaN compares False: caught here
    at = where if len(batch.keys) == 1 else f"{where}: sequence {seq} (seq_len {len(batch.keys[seq])})"
    expect(not got[starts[seq]:starts[seq + 1]].isnan().any(),
           f"{at}: the output holds NaN. Your op read cache slots no token was written to (they hold NaN "
           "here): the last block of a sequence is filled only up to seq_len, the block table's padding "
           "and other blocks belong to no one. Mask them out of the scores AND the values (0 x NaN is NaN).")
    for message, mistake in MISTAKES:
        wrong = expected_output(batch, **mistake)
        if (wrong - expected).abs().max().item() > ATOL and (got.double() - wrong).abs().max().item() <= ATOL:
            raise LabCheckFailed(f"{at}: max error {error.max().item():.3g} (allowed {ATOL:g}). It looks like "
                                 f"{message}.")
    raise LabCheckFailed(f"{at}: max error {error[starts[seq]:starts[seq + 1]].max().item():.3g} from dense "
                         f"attention over the true K/V (allowed {ATOL:g})")


# A budget smaller than the prompts: they are prefilled in chunks over their own cached context,
# and a step mixes one prompt's chunk with the other's decodes.
ENGINE_SETTINGS = dict(block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4,
                       max_model_len=256)


def check_attention_backend(name: str, prompts=PROMPTS[1:3], max_tokens: int = 12,
                            **engine_kwargs) -> list[list[int]]:
    """The backend registered as `name` inside `LLM(attention_backend=name)` on the bundled model:
    greedy tokens equal transformers' (`ENGINE_SETTINGS`: chunked prefill, mixed steps)."""
    try:
        get_ops(name)
    except ValueError as error:  # not registered, or an op missing
        raise LabCheckFailed(str(error)) from None
    kwargs = ENGINE_SETTINGS | engine_kwargs | dict(attention_backend=name)
    return assert_greedy_matches_transformers(prompts, max_tokens, **kwargs)
