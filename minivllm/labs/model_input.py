"""Lab 06's checks: the model runner's flat batch for a mixed step (`notebooks/labs/lab06_model_input.ipynb`).

The learner writes `build_flat_batch` in a `ModelRunner` subclass: python lists, one entry per
new token or per sequence, prefills first (vLLM 0.6: `ModelInputForGPUBuilder` in
`vllm/worker/model_runner.py`). `pack_model_input` (given) turns them into the tensors the model
reads. The checks compare every field with what the package's own `ModelRunner.prepare_model_input`
builds from the same scheduled groups, then run the learner's runner inside a real `LLM` with
chunked prefill and prefix caching, greedy output token for token against transformers.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.metadata import pad_block_tables, slot_of, to_device
from minivllm.config import CacheConfig, EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.step_observer import StepObserver
from minivllm.entrypoints.llm import LLM
from minivllm.labs import expect, expect_yours, passed
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceData, SequenceGroupMetadata
from minivllm.viz.device import engine_kwargs as device_kwargs
from minivllm.worker.model_runner import ModelInput, ModelRunner


@dataclass
class FlatBatch:
    """One step's batch as python lists, prefill sequences first, then decodes.

    input_ids, positions, slot_mapping  [num_tokens]  each new token's id, position in its
                                        sequence, and KV-cache slot
    block_tables                        [num_seqs] lists of physical block numbers
    context_lens                        [num_seqs]  tokens already in the cache (cached prefix,
                                        earlier chunks; a decode: all but its last token)
    query_lens                          [num_seqs]  new tokens this step (1 for a decode)
    num_prefills                        sequences that prefill (they come first)
    selected_token_indices              rows of the token stream that get logits: the last new
                                        token of each sequence that samples this step
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    num_prefills: int
    selected_token_indices: list[int]


def pack_model_input(batch: FlatBatch, seq_group_metadata_list: list[SequenceGroupMetadata],
                     device: torch.device | str) -> ModelInput:
    """The tensors of `batch` on `device`: what `ModelRunner.prepare_model_input` returns. The
    per-request sampling bookkeeping comes from `SamplingMetadata.prepare`; the logits rows are
    `batch.selected_token_indices`."""
    seq_lens = [c + q for c, q in zip(batch.context_lens, batch.query_lens)]
    n = batch.num_prefills

    def tensor(values, dtype):
        return to_device(torch.tensor(values, dtype=dtype), device)

    attn_metadata = AttentionMetadata(
        num_prefills=n,
        num_prefill_tokens=sum(batch.query_lens[:n]),
        num_decode_tokens=len(batch.query_lens) - n,
        slot_mapping=tensor(batch.slot_mapping, torch.int64),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start_loc=tensor(list(itertools.accumulate(batch.query_lens, initial=0)), torch.int32),
        block_tables=to_device(pad_block_tables(batch.block_tables), device),
        max_query_len=max(batch.query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    group_query_lens = [m.token_chunk_size if m.is_prompt else 1 for m in seq_group_metadata_list]
    sampling = SamplingMetadata.prepare(seq_group_metadata_list, group_query_lens, device)
    sampling = SamplingMetadata(sampling.seq_groups, tensor(batch.selected_token_indices, torch.int64))
    return ModelInput(input_ids=tensor(batch.input_ids, torch.int64),
                      positions=tensor(batch.positions, torch.int64),
                      attn_metadata=attn_metadata, sampling_metadata=sampling)


def flat_batch_of(model_input: ModelInput, seq_group_metadata_list: list[SequenceGroupMetadata]) -> FlatBatch:
    """The lists a `ModelInput` was packed from (block tables read from the scheduled groups:
    the packed tensor pads them)."""
    md = model_input.attn_metadata
    query_lens = torch.diff(md.query_start_loc).tolist()
    return FlatBatch(
        input_ids=model_input.input_ids.tolist(), positions=model_input.positions.tolist(),
        slot_mapping=md.slot_mapping.tolist(),
        block_tables=[list(m.block_tables[seq_id]) for m in seq_group_metadata_list for seq_id in m.seq_data],
        context_lens=[s - q for s, q in zip(md.seq_lens.tolist(), query_lens)], query_lens=query_lens,
        num_prefills=md.num_prefills,
        selected_token_indices=model_input.sampling_metadata.selected_token_indices.tolist())


# ---------------------------------------------------------------------------------- the cases
BLOCK_SIZE = 4  # small blocks, so a few tokens already cross block boundaries


def _group(request_id: str, is_prompt: bool, seqs: dict[int, tuple[list[int], list[int], int, list[int]]],
           chunk: int, do_sample: bool = True) -> SequenceGroupMetadata:
    """seqs: seq_id -> (prompt ids, output ids, num_computed_tokens, block table)."""
    seq_data, tables = {}, {}
    for seq_id, (prompt, output, computed, table) in seqs.items():
        seq_data[seq_id] = SequenceData(list(prompt), list(output), num_computed_tokens=computed)
        tables[seq_id] = list(table)
    return SequenceGroupMetadata(request_id, is_prompt, seq_data, SamplingParams(temperature=0.0), tables,
                                 chunk, do_sample=do_sample)


def _prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def cases() -> dict[str, list[SequenceGroupMetadata]]:
    """Scheduled batches (block_size 4), each testing one rule of the flat batch."""
    return {
        "one whole prompt": [_group("A", True, {0: (_prompt(10, 6), [], 0, [3, 8])}, 6)],
        "one decode": [_group("B", False, {1: (_prompt(20, 5), [90, 91, 92], 7, [5, 1])}, 1)],
        "prefill after a cached prefix (3 cached, 4 new)": [
            _group("A", True, {0: (_prompt(11, 7), [], 3, [7, 2])}, 4)],
        "a middle chunk of a long prompt (no logits)": [
            _group("A", True, {0: (_prompt(30, 13), [], 4, [6, 0, 9, 4])}, 5, do_sample=False)],
        "a decode whose token opens a new block": [
            _group("B", False, {1: (_prompt(40, 6), [70, 71, 72], 8, [2, 11, 5])}, 1)],
        "a prompt recomputed after preemption (prompt and outputs)": [
            _group("C", True, {2: (_prompt(50, 5), [80, 81], 0, [9, 3])}, 7)],
        "one request decoding two sequences (n=2)": [
            _group("D", False, {3: (_prompt(60, 5), [61, 62], 6, [1, 4]), 4: (_prompt(60, 5), [63, 64], 6, [1, 5])},
                   1)],
        "a mixed step: cached prefill, middle chunk, two decodes": [
            _group("A", True, {0: (_prompt(11, 7), [], 3, [7, 2])}, 4),
            _group("E", True, {5: (_prompt(100, 20), [], 8, [12, 13, 14, 15, 16])}, 6, do_sample=False),
            _group("B", False, {1: (_prompt(21, 5), [26, 27, 28, 29, 30], 9, [1, 5, 6])}, 1),
            _group("C", False, {2: (_prompt(31, 4), [35, 36], 5, [3, 4])}, 1)],
    }


def lab_engine_config(block_size: int = BLOCK_SIZE) -> EngineConfig:
    """The bundled model's engine config on the CPU with `block_size`-token blocks (the cases')."""
    config = EngineArgs(device="cpu", max_model_len=256).create_engine_config()
    return dataclasses.replace(config, cache_config=CacheConfig(block_size=block_size))


def _first_difference(field: str, expected, got, batch: FlatBatch) -> str:
    """Where two values of one field differ, said in the learner's terms."""
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return f"{field} has {len(got)} entries, expected {len(expected)}: expected {expected}, got {got}"
        index = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
        where = f"token {index}" if field in ("input_ids", "positions", "slot_mapping") else f"entry {index}"
        if field == "slot_mapping" and index < len(batch.positions):
            where += f" (position {batch.positions[index]})"
        return (f"{field} differs at {where}: expected {expected[index]}, got {got[index]} "
                f"(expected {expected}, got {got})")
    return f"{field}: expected {expected!r}, got {got!r}"


def check_slots(slots_for: Callable[[list[int], int, int, int], list[int]]) -> None:
    """`slots_for(block_table, start, num_tokens, block_size)`: the cache slots of positions
    start .. start + num_tokens - 1, against `attention.metadata.slot_of`."""
    slot_cases = [([7, 2], 0, 4, 4), ([7, 2], 3, 4, 4), ([1, 5, 6], 9, 1, 4), ([3, 4], 4, 1, 4),
                  ([12, 0, 9], 14, 18, 16), ([0], 0, 1, 16)]
    for table, start, num_tokens, block_size in slot_cases:
        expected = [slot_of(table[p // block_size], p, block_size) for p in range(start, start + num_tokens)]
        call = f"slots_for({table}, start={start}, num_tokens={num_tokens}, block_size={block_size})"
        got = slots_for(list(table), start, num_tokens, block_size)
        expect(isinstance(got, (list, tuple)), f"{call} returned {type(got).__name__}, expected a list of slots")
        got = list(got)
        expect(len(got) == len(expected), f"{call} returned {len(got)} slots, expected {len(expected)}: {expected}")
        for i, (a, b) in enumerate(zip(expected, got)):
            expect(a == b, f"{call}: position {start + i} (block table entry {(start + i) // block_size}) "
                           f"should be slot {a}, got {b}; expected {expected}")
    passed(f"slots_for: {len(slot_cases)} cases equal the package's slot_of")


def check_flat_batch(runner_cls: type) -> None:
    """Every case's `build_flat_batch` against the package's `ModelRunner.prepare_model_input`,
    field by field, then the packed tensors of `runner_cls.prepare_model_input`."""
    config = lab_engine_config()
    runner, reference = runner_cls(config, "cpu"), ModelRunner(config, "cpu")
    for name, groups in cases().items():
        expected = flat_batch_of(reference.prepare_model_input(groups), groups)
        got = runner.build_flat_batch(groups)
        expect(isinstance(got, FlatBatch), f"case {name!r}: build_flat_batch returned {type(got).__name__}, "
                                           "expected a FlatBatch")
        for field in dataclasses.fields(FlatBatch):
            want, have = getattr(expected, field.name), getattr(got, field.name)
            if isinstance(have, (tuple, range)):
                have = list(have)
            if field.name == "block_tables":
                have = [list(t) for t in have]
            if want != have:
                expect(False, f"case {name!r}: {_first_difference(field.name, want, have, got)}")
        packed = runner.prepare_model_input(groups)
        expect(flat_batch_of(packed, groups) == expected,
               f"case {name!r}: build_flat_batch is right but prepare_model_input packs something else "
               "(keep the given prepare_model_input)")
    passed(f"build_flat_batch: {len(cases())} batches equal the package's prepare_model_input, field by field")


# ---------------------------------------------------------------------------------- the engine
class MixedStepCounter(StepObserver):
    """Counts, from the scheduler's decisions, the steps that mix prefill chunks with decodes and
    the prefills that start after prefix-cached tokens (what the engine check must exercise)."""

    def __init__(self) -> None:
        self.mixed_steps = 0
        self.middle_chunks = 0
        self.cached_prefills = 0

    def on_scheduled(self, engine, scheduler_outputs) -> None:
        groups = scheduler_outputs.scheduled_seq_groups
        num_prefills = scheduler_outputs.num_prefill_groups
        self.mixed_steps += 0 < num_prefills < len(groups)
        for scheduled in groups[:num_prefills]:
            seq = scheduled.seq_group.get_seqs()[0]
            computed = seq.data.num_computed_tokens
            self.middle_chunks += computed + scheduled.token_chunk_size < seq.get_len()
            self.cached_prefills += computed > 0 and computed == (scheduled.seq_group.num_cached_tokens or 0)


# A shared opening of 26 tokens: with 16-token blocks, its first block is cached for later prompts.
SHARED_PREFIX = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
ENGINE_PROMPTS = ("ROMEO:\n", SHARED_PREFIX + "MENENIUS:\nWhat work", SHARED_PREFIX + "Second Citizen:\nOne word",
                  "JULIET:\nO Romeo, Romeo!")


def check_model_input_in_engine(worker_cls: type, runner_cls: type, max_tokens: int = 12) -> list[list[int]]:
    """`LLM(worker_cls=worker_cls)` with chunked prefill (16 tokens a step) and prefix caching:
    its runner must be a `runner_cls`, steps must mix prefill chunks and decodes, a prefill must
    start after cached tokens, and greedy output must equal transformers'."""
    llm = LLM(**device_kwargs(worker_cls=worker_cls, enable_chunked_prefill=True, max_num_batched_tokens=16,
                              max_num_seqs=4, enable_prefix_caching=True, max_model_len=256))
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    expect_yours(runner, runner_cls, "the engine's model runner", "set self.model_runner in the worker's __init__")
    # Fill the prefix cache with the shared opening, then the batch that reuses it.
    llm.generate(SHARED_PREFIX, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    counter = MixedStepCounter()
    llm.llm_engine.add_step_observer(counter)
    tokens = assert_greedy_matches_transformers(ENGINE_PROMPTS, max_tokens, llm=llm)
    expect(counter.mixed_steps > 0, "no step mixed prefill chunks with decodes: the check did not test a mixed batch")
    expect(counter.middle_chunks > 0, "no prefill was split into chunks: the check did not test chunked prefill")
    expect(counter.cached_prefills > 0, "no prefill started after prefix-cached tokens")
    passed(f"inside LLM: {counter.mixed_steps} mixed steps, {counter.middle_chunks} middle chunks, "
           f"{counter.cached_prefills} prefills after a cached prefix")
    return tokens
