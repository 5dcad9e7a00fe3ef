"""Checkers for the notebooks' exercises: each runs the learner's function on cases and says
exactly what is wrong.

The pattern of srush's puzzles: a spec in the notebook, a stub cell for the learner, a
`check_...(fn)` from here, and the solution hidden in a collapsed cell. A checker never raises
on a wrong answer (a notebook under nbval must run with the stubs in place): it prints
"✓ ..." and returns True, or prints "✗ <the first case that fails, expected vs got>" and
returns False. A stub that still raises `NotImplementedError` reads "not written yet", and so
does a prediction left at `NotImplemented`. A predict exercise's checker takes the learner's
value, not a function, and compares it with what the real engine or block manager does on the
exercise's state (its `..._scenario()` function, which the notebook then runs and draws).
`tests/viz/test_exercises.py` runs every notebook's hidden solution through its checker.

The expected answers come from the real code where there is one (`BlockSpaceManager`,
`hash_block_tokens`) and from a dense reference otherwise (softmax attention, the rejection
sampler's formula). Index of exercises: docs/exercises.md.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Iterable

import torch

from minivllm.attention.metadata import slot_of
from minivllm.core.block_manager import hash_block_tokens


class _Wrong(Exception):
    """One failing case, with the message the learner sees."""


def _run(name: str, fn: Callable, cases: Callable[[Callable], Iterable[None]]) -> bool:
    try:
        for _ in cases(fn):
            pass
    except NotImplementedError as unwritten:  # a stub's bare raise, or a prediction's placeholder
        print(f"✗ {name}: not written yet (replace {str(unwritten) or '`raise NotImplementedError`'}).")
        return False
    except _Wrong as wrong:
        print(f"✗ {name}: {wrong}")
        return False
    except Exception as error:  # the learner's code crashed: show where it hurts, not a traceback
        who = "your function" if fn is not None else "checking your answer"
        print(f"✗ {name}: {who} raised {type(error).__name__}: {error}")
        return False
    print(f"✓ {name}: all cases pass.")
    return True


def _expect(got, expected, what: str) -> None:
    if got != expected:
        raise _Wrong(f"{what}: expected {expected!r}, got {got!r}")


def _expect_close(got: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    got = torch.as_tensor(got, dtype=torch.float64)
    if got.shape != expected.shape:
        raise _Wrong(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    error = (got - expected).abs().max().item()
    if not error <= atol:
        raise _Wrong(f"{what}: max abs difference {error:.3g} from the reference (allowed {atol:g})")


def _unwritten(prediction) -> None:
    """A prediction still at its placeholder reads "not written yet"."""
    if prediction is NotImplemented:
        raise NotImplementedError("`NotImplemented` with your prediction")


def _bm_seq(seq_id: int, token_ids: list[int], block_size: int):
    """A one-sequence request for driving a `BlockSpaceManager` by hand: (sequence, group)."""
    from minivllm.sequence import Sequence, SequenceGroup
    seq = Sequence(seq_id, None, list(token_ids), block_size)
    return seq, SequenceGroup(f"req-{seq_id}", [seq], arrival_time=float(seq_id))


# ================================================================ notebook 00: the step loop
STEP_BATCHES_PROMPT_LENS, STEP_BATCHES_MAX_TOKENS = (5, 3, 7), (4, 2, 6)


def step_batches_scenario():
    """Exercise 00.1's run: prompts of 5, 3 and 7 tokens with max_tokens 4, 2 and 6, all added
    at once, through the real engine (scripted model: `minivllm.viz.sim`)."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator
    requests = [SimRequest(name, list(range(1, p + 1)), [m]) for name, p, m
                in zip("ABC", STEP_BATCHES_PROMPT_LENS, STEP_BATCHES_MAX_TOKENS)]
    return Simulator(SchedulerConfig(max_num_seqs=8, max_model_len=64),
                     CacheConfig(block_size=4, num_gpu_blocks=32)).run(requests)


def check_step_batches(prediction: list[int]) -> bool:
    """`prediction`: the number of tokens the model computes in each engine step, in order."""
    def cases(_):
        _unwritten(prediction)
        expected = [s.num_batched_tokens for s in step_batches_scenario().snapshots]
        got = list(prediction)
        if len(got) != len(expected):
            raise _Wrong(f"the run takes {len(expected)} steps, your list has {len(got)}")
        _expect(got, expected, "tokens per step")
        yield
    return _run("step batches", None, cases)


def check_step_loop(fn: Callable) -> bool:
    """fn(engine, prompts, params) -> the generated token ids of each prompt, in the prompts'
    order, by `engine.add_request` and `engine.step()` alone (what `LLM.generate` does)."""
    from minivllm import LLM, SamplingParams

    def cases(fn):
        llm = LLM(device="cpu", seed=0)
        prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
        for max_tokens in [(6, 2, 4), (1, 1, 1), (3, 7, 2)]:
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
            expected = [list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            steps_before = llm.llm_engine.step_counter
            got = fn(llm.llm_engine, [list(p) for p in prompts], params)
            if llm.llm_engine.step_counter == steps_before:
                raise _Wrong("the engine never stepped: call engine.step() until nothing is unfinished")
            _expect([list(g) for g in got], expected, f"outputs for max_tokens={max_tokens}")
            if llm.llm_engine.has_unfinished_requests():
                raise _Wrong("requests are left unfinished in the engine")
            yield
    return _run("step loop", fn, cases)


# ================================================================ notebook 01: sizes
PEAK_BLOCKS_REQUESTS, PEAK_BLOCKS_BLOCK_SIZE = ((15, 3), (16, 20), (40, 10)), 16


def peak_blocks_scenario() -> list[int]:
    """Exercise 01.1's run, as section 5 of notebook 01 runs its workload: requests (prompt,
    output) all start at step 1, each step after the first appends one token per running
    sequence (`append_slots`), a request is freed after its last step. Returns the GPU blocks
    in use after each step (index 0 = step 1), read from the real `BlockSpaceManager`."""
    from minivllm.core.block_manager import BlockSpaceManager
    from minivllm.sequence import SequenceStatus
    block_size, pool = PEAK_BLOCKS_BLOCK_SIZE, 64
    bm = BlockSpaceManager(block_size, pool, 0, watermark=0.0)
    seqs = []
    for i, (p, _) in enumerate(PEAK_BLOCKS_REQUESTS):
        seq, group = _bm_seq(i, [7] * p, block_size)
        bm.allocate(group)
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    used, running, step = [], list(range(len(seqs))), 0
    while running:
        step += 1
        if step > 1:
            for i in running:
                seqs[i].append_token_id(7, {7: 0.0})
                bm.append_slots(seqs[i])
        used.append(pool - bm.get_num_free_gpu_blocks())
        for i in [i for i in running if step == PEAK_BLOCKS_REQUESTS[i][1]]:
            bm.free(seqs[i])
        running = [i for i in running if step < PEAK_BLOCKS_REQUESTS[i][1]]
    return used


def check_peak_blocks(prediction: tuple[int, int]) -> bool:
    """`prediction`: (the most blocks in use at once, the first step at which that happens)."""
    def cases(_):
        _unwritten(prediction)
        used = peak_blocks_scenario()
        peak = max(used)
        _expect(tuple(prediction), (peak, used.index(peak) + 1), "(peak blocks, step of the peak)")
        yield
    return _run("peak blocks", None, cases)


def check_kv_bytes_from_config(fn: Callable[[dict, str], int]) -> bool:
    """fn(config, dtype) -> KV-cache bytes per token for a Hugging Face `config.json` (a dict)
    and a dtype name ("float32", "float16", "bfloat16"). As `CacheEngine` reads a config: a
    missing `num_key_value_heads` means one K/V head per attention head, an explicit
    `head_dim` wins over `hidden_size / num_attention_heads`."""
    from transformers import LlamaConfig

    from minivllm.config import ModelConfig
    from minivllm.worker.cache_engine import CacheEngine

    configs = [
        ("Llama-3-8B", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32), "bfloat16"),
        ("an MHA model (no num_key_value_heads)", dict(hidden_size=2048, num_attention_heads=16, num_hidden_layers=24), "float16"),
        ("Qwen3-0.6B (head_dim 128 > 1024 / 16)", dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=28), "bfloat16"),
        ("a tiny model in fp32", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3), "float32"),
    ]

    def cases(fn):
        for name, config, dtype in configs:
            model_config = ModelConfig(skip_tokenizer_init=True, hf_config=LlamaConfig(**config))
            expected = CacheEngine.get_cache_block_size(1, model_config, getattr(torch, dtype))
            _expect(fn(dict(config), dtype), expected, f"{name}, {dtype}")
            yield
    return _run("kv_bytes_from_config", fn, cases)


# ================================================================ notebooks 02/10: slot mapping
def check_slot_owner(fn: Callable[[dict[str, list[int]], dict[str, int], int, int], tuple[str, int] | None]) -> bool:
    """fn(block_tables, lengths, slot, block_size) -> (sequence, position) whose K/V the flat
    cache slot holds, or None when no token lives there (a free block, or past a sequence's end)."""
    def cases(fn):
        rng = random.Random(0)
        for block_size in (1, 4, 16):
            blocks = rng.sample(range(24), 12)
            tables = {"A": blocks[:5], "B": blocks[5:7], "C": blocks[7:11]}
            lengths = {name: (len(table) - 1) * block_size + rng.randint(1, block_size) for name, table in tables.items()}
            owner = {slot_of(table[p // block_size], p, block_size): (name, p)
                     for name, table in tables.items() for p in range(lengths[name])}
            for slot in rng.sample(range(24 * block_size), min(24 * block_size, 40)):
                _expect(fn(tables, lengths, slot, block_size), owner.get(slot),
                        f"block_tables={tables}, lengths={lengths}, block_size={block_size}, slot={slot}")
            yield
    return _run("slot_owner", fn, cases)


# ================================================================ notebook 02: admission
ADMISSION_CALLS = (("ask", "A", 30), ("ask", "B", 41), ("ask", "C", 80), ("ask", "D", 40), ("ask", "E", 1),
                   ("ask", "F", 72), ("free", "A", 0), ("ask", "B", 41))  # (call, request, prompt tokens)


def admission_scenario() -> list[tuple[str, str]]:
    """Exercise 02.2's calls on a real `BlockSpaceManager` (20 GPU blocks of 4 tokens,
    watermark 0.1): each "ask" calls `can_allocate` and allocates when it says OK; "free"
    frees the request. Returns (request, status name) for every "ask", in order."""
    from minivllm.core.block_manager import AllocStatus, BlockSpaceManager
    bm = BlockSpaceManager(4, 20, 0, watermark=0.1)
    seqs, answers = {}, []
    for seq_id, (call, name, num_tokens) in enumerate(ADMISSION_CALLS):
        if call == "free":
            bm.free(seqs.pop(name))
            continue
        seq, group = _bm_seq(seq_id, [1] * num_tokens, 4)
        status = bm.can_allocate(group)
        answers.append((name, status.name))
        if status is AllocStatus.OK:
            bm.allocate(group)
            seqs[name] = seq
    return answers


def check_admission(prediction: list[str]) -> bool:
    """`prediction`: "OK", "LATER" or "NEVER" for every `can_allocate` of exercise 02.2, in order."""
    def cases(_):
        _unwritten(prediction)
        answers = admission_scenario()
        got = list(prediction)
        if len(got) != len(answers):
            raise _Wrong(f"there are {len(answers)} calls to can_allocate, your list has {len(got)}")
        for index, ((name, status), guess) in enumerate(zip(answers, got)):
            _expect(guess, status, f"call {index + 1}, can_allocate({name})")
            yield
    return _run("admission", None, cases)


# ================================================================ notebook 02: the free list
FREE_LIST_BLOCK_SIZE, FREE_LIST_NUM_BLOCKS = 4, 8


def free_list_scenario():
    """Exercise 02.3's calls on a real `BlockSpaceManager` (8 blocks of 4 tokens, watermark 0):
    allocate A (6 tokens) and B (5), A grows by 3 tokens, free B, allocate C (13), free A,
    allocate D (3). Returns (the manager, {name: sequence})."""
    from minivllm.core.block_manager import BlockSpaceManager
    from minivllm.sequence import SequenceStatus
    bm = BlockSpaceManager(FREE_LIST_BLOCK_SIZE, FREE_LIST_NUM_BLOCKS, 0, watermark=0.0)
    seqs = {}

    def admit(name, num_tokens):
        seq, group = _bm_seq(len(seqs), list(range(1, num_tokens + 1)), FREE_LIST_BLOCK_SIZE)
        bm.allocate(group)
        seq.status = SequenceStatus.RUNNING
        seqs[name] = seq

    admit("A", 6)
    admit("B", 5)
    for token in (7, 8, 9):
        seqs["A"].append_token_id(token, {token: 0.0})
        bm.append_slots(seqs["A"])
    bm.free(seqs["B"])
    admit("C", 13)
    bm.free(seqs["A"])
    admit("D", 3)
    return bm, seqs


def check_free_list(prediction: dict[str, list[int]]) -> bool:
    """`prediction`: {"C": C's block table, "D": D's block table} after exercise 02.3's calls."""
    def cases(_):
        _unwritten(prediction)
        bm, seqs = free_list_scenario()
        got = dict(prediction)
        for name in ("C", "D"):
            _expect(list(got.get(name, [])), bm.get_block_table(seqs[name]), f"{name}'s block table")
            yield
    return _run("free list", None, cases)


# ================================================================ notebook 03: copy-on-write
def check_append_slot_cow(fn: Callable) -> bool:
    """fn(block_table, ref_counts, free_blocks) -> (block_table, copy). Append one token whose slot
    falls in the *last* block (which has room): if that block is shared (ref count > 1), take a
    free block, move this sequence's reference to it and return the copy (src, dst); otherwise
    change nothing and return None. Mutate `ref_counts` and `free_blocks` in place."""
    def cases(fn):
        table, refs, free = [7, 3], {7: 1, 3: 1}, [5, 6]
        new_table, copy = fn(list(table), refs, free)
        _expect((new_table, copy, refs, free), ([7, 3], None, {7: 1, 3: 1}, [5, 6]),
                "an unshared last block is written in place: (table, copy, ref_counts, free)")
        yield
        table, refs, free = [7, 3], {7: 2, 3: 2}, [5, 6]
        new_table, copy = fn(list(table), refs, free)
        _expect(copy, (3, 5), "a shared last block is copied to the first free block: (src, dst)")
        _expect(new_table, [7, 5], "the table points at the copy")
        _expect(refs, {7: 2, 3: 1, 5: 1}, "ref counts (the old block loses this sequence, the copy has one)")
        _expect(free, [6], "the free list after taking one block")
        yield
    return _run("append_slot_cow", fn, cases)


# ================================================================ notebook 03: fork
def fork_scenario():
    """Exercise 03.2's calls on a real `BlockSpaceManager` (block size 4, 10 blocks): a 9-token
    prompt, two forks (three samples), then five rounds in which each live sample appends one
    token (samples 0, 1, 2 in that order); sample 2 is freed after round 2. Returns (the
    manager, the samples, the copy-on-write pairs in order)."""
    from minivllm.core.block_manager import BlockSpaceManager
    from minivllm.sequence import SequenceStatus
    bm = BlockSpaceManager(4, 10, 0, watermark=0.0)
    parent, group = _bm_seq(0, list(range(1, 10)), 4)
    bm.allocate(group)
    parent.status = SequenceStatus.RUNNING
    samples = [parent]
    for child_id in (1, 2):
        child = parent.fork(child_id)
        bm.fork(parent, child)
        samples.append(child)
    copies, live = [], list(samples)
    for round_ in range(1, 6):
        for seq in live:
            seq.append_token_id(100 + seq.seq_id, {100 + seq.seq_id: 0.0})
            copies += bm.append_slots(seq)
        if round_ == 2:
            bm.free(samples[2])
            live.remove(samples[2])
    return bm, samples, copies


def check_fork(prediction: tuple[int, int, int]) -> bool:
    """`prediction`: (copy-on-write copies made, GPU blocks in use at the end, reference count
    of the prompt's first block at the end) for exercise 03.2's calls."""
    def cases(_):
        _unwritten(prediction)
        bm, samples, copies = fork_scenario()
        first = bm.gpu_allocator.blocks[bm.get_block_table(samples[0])[0]].ref_count
        expected = (len(copies), bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks(), first)
        _expect(tuple(prediction), expected, "(copies, blocks in use, ref count of the first block)")
        yield
    return _run("fork", None, cases)


# ================================================================ notebook 04: prefix caching
PREFIX_CACHE_CALLS = (  # (what happens, request, prompt token ids), in order
    ("prefill, then free", "A", list(range(1, 9))),
    ("prefill, then free", "B", list(range(100, 112)) + [200]),
    ("prefill, then free", "C", list(range(1, 10))),
    ("prefill, then free", "D", list(range(1, 9))),
    ("prefill, keep running", "E", list(range(100, 112)) + [201]),
)


def prefix_cache_scenario():
    """Exercise 04.2's calls on a real `BlockSpaceManager` with prefix caching (block size 4,
    5 GPU blocks, watermark 0): each request of `PREFIX_CACHE_CALLS` in order is looked up,
    allocated and prefilled (its full blocks join the cache), and freed if the call says so.
    Returns (the manager, {request: its sequence}, {request: cached tokens it reused})."""
    from minivllm.core.block_manager import BlockSpaceManager
    from minivllm.sequence import SequenceStatus
    bm = BlockSpaceManager(4, 5, 0, watermark=0.0, enable_caching=True)
    seqs, reused = {}, {}
    for seq_id, (what, name, token_ids) in enumerate(PREFIX_CACHE_CALLS):
        seq, group = _bm_seq(seq_id, token_ids, 4)
        reused[name] = bm.get_num_cached_tokens(seq)
        bm.allocate(group)
        group.set_status(SequenceStatus.RUNNING)
        seq.data.num_computed_tokens = reused[name]
        group.update_num_computed_tokens(seq.get_len() - reused[name])
        bm.mark_blocks_as_computed(group)
        if what.endswith("free"):
            bm.free(seq)
            seq.status = SequenceStatus.FINISHED_STOPPED
        seqs[name] = seq
    return bm, seqs, reused


def check_prefix_cache(prediction: dict[str, int]) -> bool:
    """`prediction`: {request: prompt tokens the prefix cache gives it} for exercise 04.2."""
    def cases(_):
        _unwritten(prediction)
        _, _, reused = prefix_cache_scenario()
        got = dict(prediction)
        for name, expected in reused.items():
            _expect(got.get(name), expected, f"cached tokens of request {name}")
            yield
    return _run("prefix cache", None, cases)


def check_num_cached_tokens(fn: Callable[[set, list[int], int], int]) -> bool:
    """fn(cached_hashes, token_ids, block_size) -> how many leading prompt tokens the prefix
    cache serves, as `BlockSpaceManager.get_num_cached_tokens` counts them: whole blocks
    along the hash chain (`hash_block_tokens`), up to the first miss, never the block that
    holds the last token. `cached_hashes`: the hashes of the blocks in the cache."""
    from minivllm.core.block_manager import BlockSpaceManager
    from minivllm.sequence import SequenceStatus

    def cases(fn):
        rng = random.Random(3)
        for block_size in (4, 2, 1, 16):
            bm = BlockSpaceManager(block_size, 256, 0, watermark=0.0, enable_caching=True)
            base = [rng.randrange(1, 50) for _ in range(6 * block_size)]
            seq, group = _bm_seq(0, base, block_size)  # the cached prompt: computed, kept
            bm.allocate(group)
            group.set_status(SequenceStatus.RUNNING)
            group.update_num_computed_tokens(len(base))
            bm.mark_blocks_as_computed(group)
            cached, parent = set(), None
            for start in range(0, len(base), block_size):
                parent = hash_block_tokens(parent, tuple(base[start:start + block_size]))
                cached.add(parent)
            for n, tail in [(len(base), []), (4 * block_size, [7]), (3 * block_size + 1, [9, 9]),
                            (2 * block_size, []), (0, [5] * (2 * block_size)), (1, [])]:
                probe, _ = _bm_seq(1, base[:n] + tail, block_size)
                if not probe.get_len():
                    continue
                _expect(fn(set(cached), probe.get_token_ids(), block_size), bm.get_num_cached_tokens(probe),
                        f"block_size={block_size}, prompt = the cached prompt's first {n} tokens + {tail}")
                yield
    return _run("num_cached_tokens", fn, cases)


# ================================================================ notebook 05: batching
def _static_steps(lengths: list[int], slots: int) -> int:
    return sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))


def _continuous_steps(lengths: list[int], slots: int) -> int:
    waiting, running, steps = list(lengths), [], 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        running = [left - 1 for left in running if left > 1]
        steps += 1
    return steps


def check_batching_steps(fn: Callable[[list[int], int], tuple[int, int]]) -> bool:
    """fn(output_lengths, num_slots) -> (static steps, continuous steps): decode-only, one token per
    request per step, requests in arrival order; static batching runs each batch of `num_slots`
    requests until its longest one ends; continuous batching refills a slot at the next step."""
    def cases(fn):
        for lengths, slots in [([3, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 2), ([2, 2, 2], 3), ([1, 9, 2, 8, 3, 7], 3)]:
            _expect(tuple(fn(lengths, slots)), (_static_steps(lengths, slots), _continuous_steps(lengths, slots)),
                    f"output_lengths={lengths}, num_slots={slots}")
            yield
    return _run("batching_steps", fn, cases)


# ================================================================ notebook 05: the real engine's steps
FIRST_TOKEN_OUTPUT_LENS, FIRST_TOKEN_SLOTS = (5, 1, 3, 2), 2


def first_token_scenario():
    """Exercise 05.2's run: four 3-token prompts r0..r3 with output lengths 5, 1, 3, 2, all
    arriving at step 0, through the real engine with `max_num_seqs = 2` (scripted model)."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator
    requests = [SimRequest(f"r{i}", [1, 2, 3], [n]) for i, n in enumerate(FIRST_TOKEN_OUTPUT_LENS)]
    return Simulator(SchedulerConfig(max_num_seqs=FIRST_TOKEN_SLOTS, max_model_len=64),
                     CacheConfig(block_size=4, num_gpu_blocks=32)).run(requests)


def check_first_token_steps(prediction: tuple[list[int], int]) -> bool:
    """`prediction`: ([the step (from 0) at which each of r0..r3 gets its first token], the
    number of steps the whole run takes) for exercise 05.2."""
    def cases(_):
        _unwritten(prediction)
        result = first_token_scenario()
        firsts = [result.results[f"r{i}"].first_token_step for i in range(len(FIRST_TOKEN_OUTPUT_LENS))]
        got = tuple(prediction)
        _expect(list(got[0]), firsts, "first-token step of r0..r3")
        yield
        _expect(got[1], len(result.snapshots), "steps of the whole run")
        yield
    return _run("first-token steps", None, cases)


# ================================================================ notebook 06: the token budget
def check_admit(fn: Callable[[list[int], int, int], list[int]]) -> bool:
    """fn(prompt_lengths, max_num_batched_tokens, max_num_seqs) -> indices admitted this step:
    first come first served, stop at the first prompt that does not fit (no skipping ahead)."""
    def reference(lengths, budget, max_seqs):
        admitted, used = [], 0
        for i, n in enumerate(lengths):
            if used + n > budget or len(admitted) == max_seqs:
                break
            admitted.append(i)
            used += n
        return admitted

    def cases(fn):
        for args in [([30, 30, 30], 64, 8), ([10, 50, 4], 64, 8), ([10, 10, 10], 64, 2), ([70, 1], 64, 8)]:
            _expect(list(fn(*args)), reference(*args), f"prompt_lengths, budget, max_num_seqs = {args}")
            yield
    return _run("admit", fn, cases)


# ================================================================ notebook 06: budget and slots
STEP_ADMISSION_PROMPT_LENS = (30, 30, 20, 10)


def step_admission_scenario():
    """Exercise 06.2's run: prompts of 30, 30, 20 and 10 tokens (r0..r3), five output tokens
    each, all waiting at step 0; `max_num_seqs=3`, `max_num_batched_tokens=64`, a pool large
    enough that memory never binds (real engine, scripted model)."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator
    requests = [SimRequest(f"r{i}", list(range(1, p + 1)), [5]) for i, p in enumerate(STEP_ADMISSION_PROMPT_LENS)]
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64)
    return Simulator(config, CacheConfig(block_size=4, num_gpu_blocks=64)).run(requests)


def check_step_admission(prediction: tuple[list[list[str]], int]) -> bool:
    """`prediction`: ([the requests in the batch of steps 0, 1 and 2, each a list in batch
    order], the step at which r3's prompt runs) for exercise 06.2."""
    def cases(_):
        _unwritten(prediction)
        snapshots = step_admission_scenario().snapshots
        got = tuple(prediction)
        for step in range(3):
            _expect(list(got[0][step]), [e.request_id for e in snapshots[step].batch], f"the batch of step {step}")
            yield
        r3 = next(s.step for s in snapshots if any(e.request_id == "r3" for e in s.batch))
        _expect(got[1], r3, "the step that runs r3's prompt")
        yield
    return _run("step admission", None, cases)


# ================================================================ notebook 07: preemption
PREEMPTION_PROMPTS = {"A": (6, 0), "B": (7, 1), "C": (3, 2)}  # request -> (prompt tokens, arrival step)


def preemption_scenario():
    """Exercise 07.1's run: A, B, C (prompts of 6, 7 and 3 tokens, arriving at steps 0, 1, 2,
    nine output tokens each) on a pool of 8 GPU blocks of 4 tokens (real engine, scripted
    model, default preemption mode)."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator
    requests = [SimRequest(name, [i + 1] * p, [9], arrival_step=t)
                for i, (name, (p, t)) in enumerate(PREEMPTION_PROMPTS.items())]
    return Simulator(SchedulerConfig(max_num_seqs=8, max_model_len=64),
                     CacheConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8)).run(requests)


def check_preemption(prediction: tuple[str, int, int]) -> bool:
    """`prediction`: (the request preempted first, the step at which it is preempted, the
    tokens its prefill computes when it runs again) for exercise 07.1."""
    def cases(_):
        _unwritten(prediction)
        snapshots = preemption_scenario().snapshots
        at = next(s for s in snapshots if s.preempted_by_recompute or s.preempted_by_swap)
        victim = (at.preempted_by_recompute + at.preempted_by_swap)[0]
        again = next(e for s in snapshots[at.step + 1:] for e in s.batch if e.request_id == victim)
        got = tuple(prediction)
        _expect(got[0], victim, "the first victim")
        yield
        _expect(got[1], at.step, f"the step at which {victim} is preempted")
        yield
        _expect(got[2], again.num_tokens, f"the tokens {victim}'s prefill computes when it runs again")
        yield
    return _run("preemption", None, cases)


def swap_scenario():
    """Exercise 07.2's run: A (a 6-token prompt, 12 output tokens) at step 0, B (an 8-token
    prompt, n = 2 samples of 12 tokens) at step 1, on 8 GPU and 8 CPU blocks of 4 tokens (real
    engine, scripted model, default preemption mode)."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator
    requests = [SimRequest("A", [1] * 6, [12]), SimRequest("B", [2] * 8, [12, 12], arrival_step=1)]
    return Simulator(SchedulerConfig(max_num_seqs=8, max_model_len=64),
                     CacheConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8)).run(requests)


def check_swap(prediction: tuple[str, str, int, int]) -> bool:
    """`prediction`: (the first request preempted, "recompute" or "swap", the blocks copied to
    the CPU pool, the step) for exercise 07.2."""
    def cases(_):
        _unwritten(prediction)
        at = next(s for s in swap_scenario().snapshots if s.preempted_by_recompute or s.preempted_by_swap)
        mode = "swap" if at.preempted_by_swap else "recompute"
        victim = (at.preempted_by_swap + at.preempted_by_recompute)[0]
        got = tuple(prediction)
        for index, (expected, what) in enumerate([(victim, "the first victim"), (mode, f"how {victim} is preempted"),
                                                  (len(at.blocks_to_swap_out), "the blocks copied to the CPU pool"),
                                                  (at.step, "the step of the preemption")]):
            _expect(got[index], expected, what)
            yield
    return _run("swap", None, cases)


# ================================================================ notebook 08: chunked prefill
def check_chunked_step(fn: Callable[[int, list[int], int], list[int]]) -> bool:
    """fn(num_decodes, remaining_prompt_tokens, budget) -> prompt tokens scheduled for each prefill
    this step: decodes first (one token each), then prompt chunks in order with what is left."""
    def reference(decodes, remaining, budget):
        left, chunks = budget - decodes, []
        for n in remaining:
            take = max(min(n, left), 0)
            chunks.append(take)
            left -= take
        return chunks

    def cases(fn):
        for args in [(3, [100], 64), (0, [10, 10], 16), (16, [5], 16), (2, [30, 40, 50], 64)]:
            _expect(list(fn(*args)), reference(*args), f"num_decodes, remaining, budget = {args}")
            yield
    return _run("chunked_step", fn, cases)


# ================================================================ notebook 08: chunked prefill over steps
def chunked_prefill_scenario():
    """Exercise 08.2's run: three chats (4-token prompts, 12 output tokens) from step 0, a
    40-token document (3 output tokens) arriving at step 2; chunked prefill with
    `max_num_batched_tokens=16` (real engine, scripted model)."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.viz.sim import SimRequest, Simulator
    requests = [SimRequest(f"c{i}", [1, 2, 3, 4], [12]) for i in range(3)]
    requests.append(SimRequest("doc", list(range(1, 41)), [3], arrival_step=2))
    config = SchedulerConfig(max_num_seqs=8, max_model_len=64, enable_chunked_prefill=True, max_num_batched_tokens=16)
    return Simulator(config, CacheConfig(block_size=4, num_gpu_blocks=64)).run(requests)


def check_chunked_prefill(prediction: tuple[list[int], int]) -> bool:
    """`prediction`: ([the prompt tokens of the document in each step that prefills it, in
    order], the step at which the document gets its first token) for exercise 08.2."""
    def cases(_):
        _unwritten(prediction)
        result = chunked_prefill_scenario()
        chunks = [e.num_tokens for s in result.snapshots for e in s.batch if e.request_id == "doc" and e.is_prefill]
        got = tuple(prediction)
        _expect(list(got[0]), chunks, "the document's prompt chunks")
        yield
        _expect(got[1], result.results["doc"].first_token_step, "the step of the document's first token")
        yield
    return _run("chunked prefill", None, cases)


# ================================================================ notebook 09: RoPE
def check_llama3_inv_freq(fn: Callable) -> bool:
    """fn(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    -> Llama 3.1's scaled inv_freq [head_dim / 2], as `compute_inv_freq(..., rope_type="llama3")`."""
    from minivllm.model_executor.layers.rotary_embedding import compute_inv_freq

    def cases(fn):
        for head_dim, theta, factor, low, high, context in [(128, 500000.0, 8.0, 1.0, 4.0, 8192),
                                                            (64, 10000.0, 4.0, 1.0, 4.0, 2048),
                                                            (128, 500000.0, 32.0, 1.0, 4.0, 8192),
                                                            (32, 10000.0, 8.0, 2.0, 8.0, 64)]:
            plain = compute_inv_freq(head_dim, {"rope_type": "default", "rope_theta": theta})
            expected = compute_inv_freq(head_dim, {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                                   "low_freq_factor": low, "high_freq_factor": high,
                                                   "original_max_position_embeddings": context}).double()
            got = torch.as_tensor(fn(plain.clone(), factor, low, high, context), dtype=torch.float64)
            what = f"head_dim={head_dim}, theta={theta:g}, factor={factor:g}, low={low:g}, high={high:g}, context={context}"
            _expect_close(got / expected, torch.ones_like(expected), what + ": your inv_freq / the real one", atol=1e-5)
            yield
    return _run("llama3_inv_freq", fn, cases)


ROPE_SHIFT_REFERENCE, ROPE_SHIFT_CANDIDATES = (7, 3), ((4, 0), (3, 7), (107, 103), (8, 4), (8, 3), (14, 6))


def rope_shift_scores() -> dict[tuple[int, int], float]:
    """Exercise 09.2: the score q·k of one random query and key, rotated by the real
    `RotaryEmbedding` (head_dim 32, θ = 10000) at positions (m, n), for the reference pair
    and every candidate."""
    from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    rope = RotaryEmbedding(32, 256, {"rope_type": "default", "rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen)
    scores = {}
    for m, n in (ROPE_SHIFT_REFERENCE, *ROPE_SHIFT_CANDIDATES):
        q_m, _ = rope(torch.tensor([m]), q, k)
        _, k_n = rope(torch.tensor([n]), q, k)
        scores[(m, n)] = float((q_m * k_n).sum())
    return scores


def check_rope_shift(prediction: set) -> bool:
    """`prediction`: the candidate (m, n) pairs of exercise 09.2 whose score equals the score
    at the reference positions (7, 3)."""
    def cases(_):
        _unwritten(prediction)
        scores = rope_shift_scores()
        reference = scores[ROPE_SHIFT_REFERENCE]
        expected = {pair for pair in ROPE_SHIFT_CANDIDATES if math.isclose(scores[pair], reference, abs_tol=1e-4)}
        got = {tuple(pair) for pair in prediction}
        _expect(sorted(got), sorted(expected), "the pairs with the score of (7, 3)")
        yield
    return _run("rope shift", None, cases)


# ================================================================ notebook 10: the gather
STALE_BLOCK = 999  # a block-table entry of a freed block: no such block in the exercise's cache


def check_gather_window(fn: Callable[[torch.Tensor, list[int], int, int], torch.Tensor]) -> bool:
    """fn(key_cache [num_blocks, block_size, d], block_table, start, end) -> the keys of tokens
    start .. end - 1 [end - start, d], in token order, read through the block table. Entries of
    blocks that hold none of those tokens may be stale (STALE_BLOCK): reading them raises."""
    def cases(fn):
        cache = torch.arange(10 * 4 * 2, dtype=torch.float64).reshape(10, 4, 2)
        for table, start, end in [([3, 7], 0, 5), ([STALE_BLOCK, 3, 7], 5, 11), ([9], 0, 4),
                                  ([STALE_BLOCK, STALE_BLOCK, 0, 5, 2], 9, 17), ([6, STALE_BLOCK], 2, 3),
                                  ([STALE_BLOCK, 4, STALE_BLOCK], 7, 8), ([1, 8, STALE_BLOCK], 4, 8)]:
            expected = torch.cat([cache[b] if b != STALE_BLOCK else torch.full((4, 2), math.nan, dtype=torch.float64)
                                  for b in table])[start:end]
            _expect_close(fn(cache, table, start, end), expected, f"block_table={table}, tokens {start}..{end - 1}")
            yield
    return _run("gather_window", fn, cases)


# ================================================================ notebook 10: a NaN in one slot
NAN_PROBE_SLOTS = (29, 38, 10, 1)


def nan_key_scenario(slot: int) -> tuple[list[int], list[int]]:
    """Notebook 10's cache (blocks of 4, block tables [[7, 2], [0, 9, 4], [5]], 5, 9 and 3
    tokens) with the key in `slot` set to NaN: (the sequences whose decode output turns NaN, the
    rows of section 6's prefill batch that turn NaN), from the "torch" backend's kernels."""
    from minivllm.kernels import get_ops

    ops, gen = get_ops("torch"), torch.Generator().manual_seed(0)
    block_size, seq_lens, tables = 4, [5, 9, 3], [[7, 2], [0, 9, 4], [5]]
    kv_cache = torch.full((2, 12, block_size, 2, 8), float("nan"))
    slots = torch.tensor([t[i // block_size] * block_size + i % block_size for t, n in zip(tables, seq_lens) for i in range(n)])
    ops.reshape_and_cache(torch.randn(len(slots), 2, 8, generator=gen), torch.randn(len(slots), 2, 8, generator=gen),
                          kv_cache[0], kv_cache[1], slots)
    kv_cache[0].view(-1, 2, 8)[slot] = float("nan")
    block_tables = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    decode = ops.paged_attention_decode(torch.randn(3, 4, 8, generator=gen), kv_cache[0], kv_cache[1], block_tables,
                                        torch.tensor(seq_lens, dtype=torch.int32), 8 ** -0.5)
    prefill = ops.paged_prefill_attention(torch.randn(10, 4, 8, generator=gen), kv_cache[0], kv_cache[1], block_tables[:2],
                                          torch.tensor([0, 5, 10], dtype=torch.int32),
                                          torch.tensor(seq_lens[:2], dtype=torch.int32), 8 ** -0.5)
    nan_rows = lambda out: out.isnan().flatten(1).any(1).nonzero().flatten().tolist()  # noqa: E731
    return nan_rows(decode), nan_rows(prefill)


def check_nan_key_probe(prediction: dict[int, tuple[list[int], list[int]]]) -> bool:
    """`prediction`: for each slot of NAN_PROBE_SLOTS, (the decode sequences, the prefill rows)
    whose output turns NaN when that slot's key is NaN (see `nan_key_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        for slot in NAN_PROBE_SLOTS:
            if slot not in prediction:
                raise _Wrong(f"no prediction for slot {slot}")
            decode, prefill = prediction[slot]
            _expect((sorted(decode), sorted(prefill)), nan_key_scenario(slot),
                    f"slot {slot}: (decode sequences, prefill rows) that turn NaN")
            yield
    return _run("nan_key_probe", None, cases)



# ================================================================ notebooks 10/11: attention
def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.softmax((k @ q) * scale, dim=0) @ v


def check_online_softmax_lse(fn: Callable) -> bool:
    """fn(lse, out, scores, v_tile) -> (lse, out): fold one tile of scores [T] and values [T, d]
    into a running state kept *normalised*: lse, the log-sum-exp of the scores seen so far, and
    out [d], the attention output over them. It starts at (-inf, zeros); after the last tile,
    out is softmax(scores) @ v."""
    def cases(fn):
        gen = torch.Generator().manual_seed(0)
        for n, tile in [(10, 4), (33, 8), (5, 5), (64, 16), (40, 1)]:
            q, k, v = (torch.randn(16, generator=gen, dtype=torch.float64),
                       torch.randn(n, 16, generator=gen, dtype=torch.float64) * 3,
                       torch.randn(n, 16, generator=gen, dtype=torch.float64))
            scores = k @ q * 0.25
            lse, out = torch.tensor(-math.inf, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)
            for start in range(0, n, tile):
                lse, out = fn(lse, out, scores[start:start + tile], v[start:start + tile])
            _expect_close(out, _dense(q, k, v, 0.25), f"{n} tokens in tiles of {tile}: out")
            _expect_close(torch.as_tensor(lse), torch.logsumexp(scores, 0), f"{n} tokens in tiles of {tile}: lse")
            yield
    return _run("online_softmax_lse", fn, cases)


def check_merge_partials(fn: Callable) -> bool:
    """fn(accs [S, d], maxes [S], sums [S]) -> [d]: merge the splits of split-KV attention.
    Split s attended to its own range of tokens and kept section 3's raw state: its max score
    maxes[s], its sum of exp(score - maxes[s]) sums[s] and its *unnormalised* accumulator
    accs[s] = sum of exp(score - maxes[s]) * v. An empty split has max -inf, sum 0, acc 0."""
    def cases(fn):
        gen = torch.Generator().manual_seed(1)
        for n, splits in [(12, 3), (40, 4), (7, 1), (9, 4)]:
            q, k, v = (torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(n, 8, generator=gen, dtype=torch.float64) * 2,
                       torch.randn(n, 8, generator=gen, dtype=torch.float64))
            scores, size = k @ q, -(-n // splits)
            outs, maxes, sums = torch.zeros(splits, 8, dtype=torch.float64), torch.full((splits,), -math.inf, dtype=torch.float64), torch.zeros(splits, dtype=torch.float64)
            for s in range(splits):
                part = slice(s * size, min((s + 1) * size, n))
                if part.start >= n:
                    continue  # an empty split: nothing to attend to
                maxes[s] = scores[part].max()
                weights = torch.exp(scores[part] - maxes[s])
                sums[s], outs[s] = weights.sum(), weights @ v[part]  # unnormalised: acc, not acc / l
            _expect_close(fn(outs, maxes, sums), _dense(q, k, v, 1.0), f"{n} tokens in {splits} splits")
            yield
    return _run("merge_partials", fn, cases)


# ================================================================ notebook 11: idle split-KV programs
def check_idle_programs(prediction: dict[int, int], tile_tokens: int = 32) -> bool:
    """`prediction`: num_kv_splits -> how many programs of the v2 launch over notebook 11's batch
    (sequences of 1, 32 and 45 tokens, 2 KV heads, tiles of `tile_tokens`) get no tokens and
    return at once. The expected counts come from `split_ranges`, the kernel's own arithmetic."""
    from minivllm.viz.paged_attention import split_ranges

    def cases(_):
        _unwritten(prediction)
        for num_splits in (2, 3, 4):
            idle = 2 * sum(num_splits - len(split_ranges(n, num_splits, tile_tokens)) for n in (1, 32, 45))
            _expect(prediction.get(num_splits) if isinstance(prediction, dict) else prediction, idle,
                    f"idle programs with num_kv_splits={num_splits} (of {3 * 2 * num_splits})")
            yield
    return _run("idle_programs", None, cases)


# ================================================================ notebook 12: the flattened batch
def _prepared_batch(groups: list[tuple[int, int, int]]):
    """The real `ModelRunner.prepare_model_input` on one sequence per group, given as
    (num_computed_tokens, num_new_tokens, prompt_len); a group is a prefill chunk while
    num_computed_tokens < prompt_len, and it samples only if the chunk ends the prompt."""
    from minivllm import EngineArgs, SamplingParams
    from minivllm.sequence import SequenceData, SequenceGroupMetadata
    from minivllm.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineArgs(device="cpu").create_engine_config(), "cpu")
    block_size, metadata = runner.engine_config.cache_config.block_size, []
    for i, (computed, new, prompt_len) in enumerate(groups):
        tokens = [100 + t for t in range(computed + new)]
        is_prompt = computed < prompt_len
        data = SequenceData(tokens[:prompt_len], tokens[prompt_len:])
        data.num_computed_tokens = computed
        table = list(range(10 * i, 10 * i + -(-(computed + new) // block_size)))
        metadata.append(SequenceGroupMetadata(str(i), is_prompt, {i: data}, SamplingParams(temperature=0.0), {i: table},
                                              new, do_sample=not is_prompt or computed + new >= prompt_len))
    batch = runner.prepare_model_input(metadata)
    return (batch.positions.tolist(), batch.attn_metadata.query_start_loc.tolist(), batch.attn_metadata.seq_lens.tolist(),
            batch.sampling_metadata.selected_token_indices.tolist())


FLAT_BATCH_FIELDS = ("positions", "query_start_loc", "seq_lens", "selected_token_indices")


def check_flat_batch(fn: Callable[[list[tuple[int, int, int]]], tuple]) -> bool:
    """fn(groups) -> (positions, query_start_loc, seq_lens, selected_token_indices) of the flat
    batch, each a list; groups: one sequence each, (num_computed_tokens, num_new_tokens,
    prompt_len), prefills first. The expected lists come from `ModelRunner.prepare_model_input`."""
    def cases(fn):
        for groups in [[(0, 5, 5)], [(3, 4, 7), (9, 1, 6), (5, 1, 5)], [(0, 4, 10), (12, 1, 3)],
                       [(4, 4, 10), (0, 3, 3), (10, 1, 6), (4, 1, 3)], [(16, 1, 16), (20, 1, 2)]]:
            got, expected = fn(groups), _prepared_batch(groups)
            if not isinstance(got, (tuple, list)) or len(got) != 4:
                raise _Wrong(f"groups={groups}: return the four lists {FLAT_BATCH_FIELDS}, got {got!r}")
            for name, g, e in zip(FLAT_BATCH_FIELDS, got, expected):
                _expect(list(g), e, f"groups={groups}: {name}")
            yield
    return _run("flat_batch", fn, cases)


def cpu_pool_scenario(max_model_len: int, max_num_seqs: int = 3, space_gib: str = "0.002") -> int:
    """The GPU-block count of an engine built on this CPU with MINIVLLM_CPU_KVCACHE_SPACE=space_gib
    (the bundled model, fp32, blocks of 16): what `Worker.determine_num_available_blocks` gives."""
    import os

    from minivllm import EngineArgs, LLMEngine
    from minivllm.worker.worker import CPU_KVCACHE_SPACE_ENV

    saved = os.environ.get(CPU_KVCACHE_SPACE_ENV)
    os.environ[CPU_KVCACHE_SPACE_ENV] = space_gib
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", max_model_len=max_model_len, max_num_seqs=max_num_seqs))
        return engine.cache_config.num_gpu_blocks
    finally:
        if saved is None:
            del os.environ[CPU_KVCACHE_SPACE_ENV]
        else:
            os.environ[CPU_KVCACHE_SPACE_ENV] = saved


def check_cpu_pool(prediction: dict[int, int]) -> bool:
    """`prediction`: max_model_len -> the number of KV blocks an engine gets on a CPU with
    MINIVLLM_CPU_KVCACHE_SPACE=0.002 (GiB), max_num_seqs=3, for max_model_len 100 and 1000."""
    def cases(_):
        _unwritten(prediction)
        for max_model_len in (100, 1000):
            _expect(prediction.get(max_model_len) if isinstance(prediction, dict) else prediction,
                    cpu_pool_scenario(max_model_len), f"num_gpu_blocks with max_model_len={max_model_len}")
            yield
    return _run("cpu_pool", None, cases)


# ================================================================ notebook 13: sampling
def check_top_p_mask(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> bool:
    """fn(probs [V], top_p) -> bool mask [V] of the tokens kept: the smallest set of most likely
    tokens whose probabilities sum to at least top_p (the most likely token is always kept)."""
    def reference(probs, p):
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]  # mass strictly above each token
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = before < p
        return keep

    def cases(fn):
        for probs, p in [([0.5, 0.3, 0.2], 0.5), ([0.5, 0.3, 0.2], 0.6), ([0.1, 0.6, 0.3], 0.95), ([0.25] * 4, 1.0),
                         ([0.7, 0.2, 0.1], 0.01)]:
            probs = torch.tensor(probs, dtype=torch.float64)
            _expect(fn(probs, p).tolist(), reference(probs, p).tolist(), f"probs={probs.tolist()}, top_p={p}")
            yield
    return _run("top_p_mask", fn, cases)


# ================================================================ notebook 13: the filters in a row
FILTER_PROBS = (0.30, 0.25, 0.20, 0.15, 0.10)
FILTER_SETTINGS = ((3, 0.6, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.5), (2, 1.0, 0.9))  # (top_k, top_p, min_p); 0 = off


def check_filter_chain(prediction: list[list[int]]) -> bool:
    """`prediction`: for each (top_k, top_p, min_p) of FILTER_SETTINGS, the token ids that survive
    on the distribution FILTER_PROBS (token i has probability FILTER_PROBS[i]), sorted. The
    expected sets come from the sampler's `kept_mask` (kernels/reference.py)."""
    from minivllm.kernels.reference import kept_mask

    def cases(_):
        _unwritten(prediction)
        logits = torch.tensor([FILTER_PROBS]).log()
        if len(prediction) != len(FILTER_SETTINGS):
            raise _Wrong(f"predict one list per setting ({len(FILTER_SETTINGS)}), got {len(prediction)}")
        for guess, (k, p, min_p) in zip(prediction, FILTER_SETTINGS):
            kept = kept_mask(logits, torch.tensor([k]), torch.tensor([p]), torch.tensor([min_p]))[0]
            _expect(sorted(guess), kept.nonzero().flatten().tolist(), f"top_k={k}, top_p={p}, min_p={min_p}: tokens kept")
            yield
    return _run("filter_chain", None, cases)


# ================================================================ notebook 14: latency metrics
def check_latency_metrics(fn: Callable[[float, list[float]], tuple[float, float]]) -> bool:
    """fn(arrival_time, token_times) -> (TTFT, TPOT): time to first token, and time per output
    token after the first, (last - first) / (tokens - 1); TPOT is 0.0 for a single token."""
    def cases(fn):
        for arrival, times in [(0.0, [0.5, 0.6, 0.7]), (1.0, [1.2]), (2.0, [2.5, 2.5, 3.5, 4.5])]:
            expected = (times[0] - arrival, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0)
            got = tuple(fn(arrival, times))
            if len(got) != 2 or not all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, expected)):
                raise _Wrong(f"arrival={arrival}, token_times={times}: expected {expected}, got {got}")
            yield
    return _run("latency_metrics", fn, cases)


# ================================================================ notebook 14: multi-step runs
MULTI_STEP_MAX_TOKENS = {"a": 5, "b": 20, "c": 9, "d": 1}


def multi_step_scenario(max_tokens: dict[str, int] = MULTI_STEP_MAX_TOKENS) -> dict[str, list[int]]:
    """request -> the tokens each engine step added to it (steps where it got none left out), for
    greedy requests with these max_tokens on the bundled model, num_scheduler_steps=8."""
    from minivllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", num_scheduler_steps=8, block_size=8,
                                                   num_gpu_blocks_override=40))
    for request_id, n in max_tokens.items():
        engine.add_request(request_id, "ROMEO:", SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    seen: dict[str, int] = {}
    added: dict[str, list[int]] = {request_id: [] for request_id in max_tokens}
    while engine.has_unfinished_requests():
        for output in engine.step():
            n = len(output.outputs[0].token_ids)
            if n > seen.get(output.request_id, 0):
                added[output.request_id].append(n - seen.get(output.request_id, 0))
                seen[output.request_id] = n
    return added


def check_multi_step_tokens(prediction: dict[str, list[int]]) -> bool:
    """`prediction`: request -> the new tokens each engine step gives it (MULTI_STEP_MAX_TOKENS,
    num_scheduler_steps=8), checked against a real engine (`multi_step_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        expected = multi_step_scenario()
        for request_id, n in MULTI_STEP_MAX_TOKENS.items():
            got = prediction.get(request_id) if isinstance(prediction, dict) else prediction
            _expect(list(got) if isinstance(got, (list, tuple)) else got, expected[request_id],
                    f"request {request_id!r} (max_tokens={n}): new tokens per engine step")
            yield
    return _run("multi_step_tokens", None, cases)


# ================================================================ notebook 15: SSE
def check_parse_sse(fn: Callable[[str], list[str]]) -> bool:
    """fn(body) -> the `data:` payloads of a Server-Sent Events body, in order, stopping at
    `data: [DONE]` (blank lines separate events; other lines are ignored)."""
    def cases(fn):
        for body, expected in [('data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n', ['{"a": 1}', '{"b": 2}']),
                               ("data: x\n\n: a comment\n\ndata: y\n\ndata: [DONE]\n\ndata: z\n\n", ["x", "y"]),
                               ("data: [DONE]\n\n", [])]:
            _expect(list(fn(body)), expected, f"body={body!r}")
            yield
    return _run("parse_sse", fn, cases)


def check_text_to_return(fn: Callable[[str, int, int, bool], tuple[str, int]]) -> bool:
    """fn(output_text, returned, buffer_length, finished) -> (the text a DELTA output carries,
    the characters returned after it): from `returned` to the end, less the last
    `buffer_length` characters while the sequence runs (a stop string may still cut them). The
    expected values come from the engine's own `Sequence.get_output_text_to_return`."""
    from minivllm.sequence import Sequence, SequenceStatus

    def cases(fn):
        for text, returned, buffer_length, finished in [("To be", 0, 0, False), ("To be, or", 5, 0, False),
                                                        ("To be, or", 2, 3, False), ("To be, or", 6, 3, True),
                                                        ("ab", 0, 3, False), ("To be", 5, 2, False)]:
            seq = Sequence(0, None, [1], block_size=16)
            seq.output_text, seq.last_output_text_offset = text, returned
            seq.status = SequenceStatus.FINISHED_STOPPED if finished else SequenceStatus.RUNNING
            expected = (seq.get_output_text_to_return(buffer_length, delta=True), seq.last_output_text_offset)
            got = fn(text, returned, buffer_length, finished)
            _expect(tuple(got) if isinstance(got, (tuple, list)) else got, expected,
                    f"output_text={text!r}, returned={returned}, buffer_length={buffer_length}, finished={finished}")
            yield
    return _run("text_to_return", fn, cases)


def delta_stream_scenario(stop: list[str]) -> list[str]:
    """The text of each DELTA output of notebook 15's greedy request ("ROMEO:", max_tokens=8)
    with these stop strings, from a real engine on the bundled model."""
    from minivllm import EngineArgs, LLMEngine, SamplingParams
    from minivllm.sampling_params import RequestOutputKind

    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", seed=0, max_model_len=256))
    engine.add_request("delta", "ROMEO:", SamplingParams(temperature=0.0, max_tokens=8, stop=stop,
                                                         output_kind=RequestOutputKind.DELTA))
    texts = []
    while engine.has_unfinished_requests():
        texts += [output.outputs[0].text for output in engine.step()]
    return texts


def check_delta_stream(prediction: list[str]) -> bool:
    """`prediction`: the text of every DELTA output, step by step, of notebook 15's request
    with stop=[" love"], checked against a real engine (`delta_stream_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        _expect(list(prediction) if isinstance(prediction, (list, tuple)) else prediction, delta_stream_scenario([" love"]),
                'the DELTA texts with stop=[" love"]')
        yield
    return _run("delta_stream", None, cases)


# ================================================================ speculative decoding
def check_rejection_step(fn: Callable[[torch.Tensor, torch.Tensor, int], tuple[float, torch.Tensor]]) -> bool:
    """fn(p [V], q [V], x) -> (probability of accepting the draft token x, the distribution to
    resample from when it is rejected): min(1, p(x)/q(x)) and norm(max(p - q, 0))."""
    def cases(fn):
        for p, q, x in [([0.5, 0.3, 0.2], [0.2, 0.6, 0.2], 1), ([0.5, 0.3, 0.2], [0.2, 0.6, 0.2], 0),
                        ([0.1, 0.1, 0.8], [0.8, 0.1, 0.1], 0), ([0.0, 1.0], [0.5, 0.5], 0)]:
            p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
            accept, residual = fn(p, q, x)
            expected = min(1.0, (p[x] / q[x]).item())
            if not math.isclose(float(accept), expected, abs_tol=1e-9):
                raise _Wrong(f"p={p.tolist()}, q={q.tolist()}, x={x}: acceptance expected {expected:.4g}, got {float(accept):.4g}")
            positive = (p - q).clamp(min=0)
            _expect_close(residual, positive / positive.sum(), f"p={p.tolist()}, q={q.tolist()}: the residual distribution",
                          atol=1e-9)
            yield
    return _run("rejection_step", fn, cases)


# ================================================================ notebook 16: tensor parallelism
def check_vocab_parallel_lookup(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> bool:
    """fn(weight_shard [rows, hidden], ids [T], vocab_start) -> [T, hidden]: one rank's part of a
    vocabulary-parallel embedding, which holds rows vocab_start .. vocab_start + rows of the
    table. Its ids get their rows, every other id zeros, so the all-reduce (a sum over the
    ranks) gives the full lookup, as `VocabParallelEmbedding` does."""
    def cases(fn):
        gen = torch.Generator().manual_seed(3)
        for vocab, hidden, tp in [(12, 4, 2), (30, 8, 3), (16, 2, 4), (10, 3, 1)]:
            weight = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
            ids = torch.randint(0, vocab, (7,), generator=gen)
            rows, total = vocab // tp, torch.zeros(len(ids), hidden, dtype=torch.float64)
            for rank in range(tp):
                start = rank * rows
                part = torch.as_tensor(fn(weight[start:start + rows], ids, start), dtype=torch.float64)
                inside = (ids >= start) & (ids < start + rows)
                if part.shape == (len(ids), hidden) and part[~inside].abs().sum() != 0:
                    raise _Wrong(f"vocab {vocab}, tp {tp}, rank {rank}: ids outside rows {start}..{start + rows - 1} "
                                 f"must give zeros, got non-zero rows for ids {ids[~inside].tolist()}")
                _expect_close(part[inside] if part.shape == (len(ids), hidden) else part, weight[ids[inside]],
                              f"vocab {vocab}, tp {tp}, rank {rank}: the rows of ids {ids[inside].tolist()}")
                total += part
            _expect_close(total, weight[ids], f"vocab {vocab}, tp {tp}: the sum over ranks")
            yield
    return _run("vocab_parallel_lookup", fn, cases)


def tp_shapes_scenario(tp: int) -> tuple[int, int]:
    """(rows of one rank's qkv_proj weight, KV-cache bytes per token summed over all tp ranks)
    for the bundled model in fp32, from `ModelConfig` and `CacheEngine.get_cache_block_size`."""
    from minivllm.config import ModelConfig, ParallelConfig
    from minivllm.worker.cache_engine import CacheEngine

    model_config, parallel = ModelConfig(), ParallelConfig(tensor_parallel_size=tp)
    heads = model_config.hf_config.num_attention_heads // tp
    qkv_rows = (heads + 2 * model_config.get_num_kv_heads(parallel)) * model_config.get_head_size()
    return qkv_rows, tp * CacheEngine.get_cache_block_size(1, model_config, torch.float32, parallel)


def check_tp_shapes(prediction: dict[int, tuple[int, int]]) -> bool:
    """`prediction`: tp -> (rows of a rank's qkv_proj weight, KV bytes per token over all ranks)
    for tp = 1, 2, 4, 8 (`tp_shapes_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        for tp in (1, 2, 4, 8):
            got = prediction.get(tp) if isinstance(prediction, dict) else prediction
            _expect(tuple(got) if isinstance(got, (list, tuple)) else got, tp_shapes_scenario(tp),
                    f"tp={tp}: (qkv_proj rows per rank, KV bytes per token over all ranks)")
            yield
    return _run("tp_shapes", None, cases)


# ================================================================ notebook 17: what a store gives back
STORED_PROMPT = list(range(100, 127))  # 27 token ids, saved to the store by a first engine
LOOKUPS = {"the same prompt": STORED_PROMPT, "its first 24 tokens": STORED_PROMPT[:24],
           "its first 15 tokens, then others": STORED_PROMPT[:15] + [7] * 12,
           "its first token changed": [5] + STORED_PROMPT[1:],
           "the prompt and 13 more tokens": STORED_PROMPT + list(range(200, 213))}


def tokens_loaded_scenario(block_size: int = 8) -> dict[str, int]:
    """LOOKUPS name -> the tokens an engine loads from a SharedStorageConnector store that one
    engine filled with STORED_PROMPT (the consumer's `num_cached_tokens`; blocks of 8)."""
    import tempfile

    from minivllm import EngineArgs, LLMEngine, SamplingParams
    from minivllm.config import KVTransferConfig

    store = tempfile.mkdtemp(prefix="minivllm-exercise-kv-")

    def engine(role: str) -> LLMEngine:
        return LLMEngine.from_engine_args(EngineArgs(
            device="cpu", block_size=block_size, max_model_len=256, num_gpu_blocks_override=64,
            kv_transfer_config=KVTransferConfig("SharedStorageConnector", role, {"shared_storage_path": store})))

    def cached(e: LLMEngine, request_id: str, ids: list[int]) -> int:
        e.add_request(request_id, {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1))
        while e.has_unfinished_requests():
            done = [o for o in e.step() if o.finished]
        return done[0].num_cached_tokens

    cached(engine("kv_producer"), "fill", STORED_PROMPT)
    consumer = engine("kv_consumer")  # no prefix caching: every hit is a load from the store
    return {name: cached(consumer, name, ids) for name, ids in LOOKUPS.items()}


def check_tokens_loaded(prediction: dict[str, int]) -> bool:
    """`prediction`: LOOKUPS name -> tokens loaded from the store (`tokens_loaded_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        expected = tokens_loaded_scenario()
        for name in LOOKUPS:
            _expect(prediction.get(name) if isinstance(prediction, dict) else prediction, expected[name],
                    f"tokens loaded for {name}")
            yield
    return _run("tokens_loaded", None, cases)


def check_block_keys(fn: Callable[[list[int], int, str], list[str]]) -> bool:
    """fn(token_ids, block_size, root) -> one store key (a str) per reusable full block: every
    full block but the one holding the last token. A key names the block's tokens *and* every
    block before it, and the root (the model and the shard), so equal keys mean equal KV. Checked
    by its properties against `block_digests`' count, not by its hash function."""
    def cases(fn):
        rng = random.Random(4)
        for block_size in (4, 8):
            a = [rng.randrange(1000) for _ in range(5 * block_size + 3)]
            b = a[:2 * block_size + 1] + [t + 1 for t in a[2 * block_size + 1:]]  # differs inside block 2
            keys_a, keys_b = list(fn(a, block_size, "m")), list(fn(b, block_size, "m"))
            _expect(len(keys_a), (len(a) - 1) // block_size, f"block_size {block_size}, {len(a)} tokens: number of keys")
            _expect(len(list(fn(a[:4 * block_size], block_size, "m"))), 3,
                    f"block_size {block_size}, {4 * block_size} tokens (the last block holds the last token): number of keys")
            _expect(keys_a[:2] == keys_b[:2], True, f"block_size {block_size}: equal first two blocks give equal keys")
            if any(x == y for x, y in zip(keys_a[2:], keys_b[2:])):
                raise _Wrong(f"block_size {block_size}: the prompts differ in block 2, so keys 2.. must all differ")
            shifted = a[block_size:]  # block 1 of a is block 0 of shifted: the same tokens, another prefix
            if fn(shifted, block_size, "m")[0] == keys_a[1]:
                raise _Wrong(f"block_size {block_size}: the same tokens after a different prefix got the same key")
            if set(fn(a, block_size, "another model")) & set(keys_a):
                raise _Wrong(f"block_size {block_size}: another root (model or shard) must change every key")
            _expect(list(fn(a, block_size, "m")), keys_a, f"block_size {block_size}: keys are deterministic")
            yield
    return _run("block_keys", fn, cases)


# ================================================================ notebook 18: one verification step
GREEDY_STEPS = {  # case -> (the draft's k = 4 guesses, the target's arg-max at each of the k + 1 positions)
    "a": ([5, 9, 2, 7], [5, 9, 3, 7, 1]),
    "b": ([5, 9, 2, 7], [5, 9, 2, 7, 1]),
    "c": ([4, 4, 4, 4], [6, 4, 4, 4, 4]),
    "d": ([8, 3, 8, 3], [8, 3, 8, 1, 3]),
}


def greedy_step_scenario(guesses: list[int], target_argmax: list[int], vocab: int = 10) -> list[int]:
    """The tokens `RejectionSampler` emits for one sequence with greedy (one-hot) target
    distributions and a deterministic draft (one-hot q)."""
    from minivllm.model_executor.layers.rejection_sampler import NO_TOKEN, RejectionSampler

    k = len(guesses)
    target = torch.nn.functional.one_hot(torch.tensor(target_argmax), vocab).float()[None]
    draft = torch.nn.functional.one_hot(torch.tensor(guesses), vocab).float()[None]
    out = RejectionSampler()(target, torch.tensor([guesses]), torch.tensor([k]), draft, generator=torch.Generator().manual_seed(0))
    return [t for t in out[0].tolist() if t != NO_TOKEN]


def check_greedy_step(prediction: dict[str, list[int]]) -> bool:
    """`prediction`: GREEDY_STEPS case -> the tokens the step emits (`greedy_step_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        for name, (guesses, argmax) in GREEDY_STEPS.items():
            got = prediction.get(name) if isinstance(prediction, dict) else prediction
            _expect(list(got) if isinstance(got, (list, tuple)) else got, greedy_step_scenario(guesses, argmax),
                    f"case {name!r}: guesses {guesses}, target arg-max {argmax}: tokens emitted")
            yield
    return _run("greedy_step", None, cases)


def check_ngram_lookup(fn: Callable[[list[int], int, int, int], list[int]]) -> bool:
    """fn(token_ids, k, n_min, n_max) -> up to k tokens that followed the latest earlier
    occurrence of the longest suffix (n_max down to n_min tokens) that occurred before; [] if
    none. Checked against `minivllm.spec_decode.ngram_worker.ngram_lookup`."""
    from minivllm.spec_decode.ngram_worker import ngram_lookup

    def cases(fn):
        rng = random.Random(5)
        fixed = [([5, 6, 7, 8, 9, 5, 6], 3, 1, 3), ([1, 2, 3, 1, 2, 3, 1, 2], 4, 1, 3), ([1, 2, 3, 4], 2, 1, 3),
                 ([7, 7, 7, 7], 2, 1, 2), ([1, 2, 9, 1, 2, 8, 2], 2, 1, 2), ([3, 1, 2, 4, 1, 2], 5, 2, 2),
                 ([4, 5, 4], 3, 2, 3), ([6], 2, 1, 3)]
        randoms = [([rng.randrange(4) for _ in range(rng.randrange(2, 14))], rng.randrange(1, 5), 1, rng.randrange(1, 4))
                   for _ in range(40)]
        for tokens, k, n_min, n_max in fixed + randoms:
            _expect(list(fn(list(tokens), k, n_min, n_max)), ngram_lookup(tokens, k, n_min, n_max),
                    f"token_ids={tokens}, k={k}, n_min={n_min}, n_max={n_max}")
            yield
    return _run("ngram_lookup", fn, cases)


# ================================================================ notebook 19: adapters in a batch
LORA_QUEUE = [1, 2, 1, 3, 0, 2, 3, 4]  # the adapter id of each waiting request, in arrival order (0: base model)


def first_batch_scenario(max_loras: int, queue: list[int] = LORA_QUEUE) -> list[int]:
    """The requests (their index in `queue`) the real `Scheduler` puts in its first batch, with
    LoRA's `max_loras` slots and room for every request otherwise."""
    from minivllm.config import CacheConfig, LoRAConfig, SchedulerConfig
    from minivllm.core.scheduler import Scheduler
    from minivllm.lora.request import LoRARequest
    from minivllm.sampling_params import SamplingParams
    from minivllm.sequence import Sequence, SequenceGroup

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0), LoRAConfig(max_loras=max_loras))
    for i, lora_id in enumerate(queue):
        lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
        seq = Sequence(i, None, [3, 4, 5], 4, lora_request=lora)
        scheduler.add_seq_group(SequenceGroup(str(i), [seq], float(i), SamplingParams(max_tokens=2), lora_request=lora))
    metadata, _, _ = scheduler.schedule()
    return sorted(int(m.request_id) for m in metadata)


def check_first_batch(prediction: dict[int, list[int]]) -> bool:
    """`prediction`: max_loras -> the requests of LORA_QUEUE in the first batch (`first_batch_scenario`)."""
    def cases(_):
        _unwritten(prediction)
        for max_loras in (1, 2, 3):
            got = prediction.get(max_loras) if isinstance(prediction, dict) else prediction
            _expect(sorted(got) if isinstance(got, (list, tuple)) else got, first_batch_scenario(max_loras),
                    f"max_loras={max_loras}, adapters {LORA_QUEUE}: the requests in the first batch")
            yield
    return _run("first_batch", None, cases)


def check_lora_mapping(fn: Callable[[list[int], int], tuple[list[int], list[int], list[int]]]) -> bool:
    """fn(token_lora_indices, num_slots) -> (sorted_token_ids, num_tokens_per_slot, slot_start):
    the rows grouped by slot (base-model rows, -1, first; batch order kept inside a group), the
    rows each slot has, and where each slot's rows start in sorted_token_ids. Checked against
    `LoRAMapping.build` (kernels/lora_reference.py)."""
    from minivllm.kernels.lora_reference import LoRAMapping

    def cases(fn):
        rng = random.Random(6)
        fixed = [([1, -1, 0, 0, 1, -1, 0, 1, 1, 0], 2), ([-1, -1, -1], 2), ([2, 2, 0], 3), ([0], 1)]
        randoms = [([rng.randrange(-1, 4) for _ in range(rng.randrange(1, 16))], 4) for _ in range(20)]
        for indices, num_slots in fixed + randoms:
            mapping = LoRAMapping.build(torch.tensor(indices), num_slots)
            expected = (mapping.sorted_token_ids.tolist(), mapping.num_tokens_per_slot.tolist(), mapping.slot_start.tolist())
            got = fn(list(indices), num_slots)
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise _Wrong(f"indices={indices}: return (sorted_token_ids, num_tokens_per_slot, slot_start), got {got!r}")
            for name, g, e in zip(("sorted_token_ids", "num_tokens_per_slot", "slot_start"), got, expected):
                _expect(list(g), e, f"token_lora_indices={indices}, num_slots={num_slots}: {name}")
            yield
    return _run("lora_mapping", fn, cases)
