"""Lab 02's checks: a learner's prefix cache (the chained block hash, the lookup and registration
of full blocks) and its LRU eviction of unreferenced cached blocks, first on focused cases, then
inside a real `LLM` with `enable_prefix_caching=True` (`block_manager_cls`).

Expected values come from the package's `hash_block_tokens`, `BlockAllocator` and `PrefixCache`
run on the same calls; a learner's hash may differ in value from the package's, so hashes are
compared by what they must do (equal content and prefix: equal; anything else: different).
The whole manager is compared with `BlockSpaceManager` by lab 01's `Twin`, caching on.
"""

from __future__ import annotations

import random
from typing import Callable

from minivllm.core.block_allocator import BlockAllocator, Device, OutOfBlocksError
from minivllm.core.prefix_caching import PrefixCache, hash_block_tokens
from minivllm.entrypoints.llm import LLM
from minivllm.labs import LabCheckFailed, expect, passed
from minivllm.labs.block_manager import (ALL_OPERATIONS, NUM_RANDOM_OPS, Twin, assert_all_blocks_free, format_steps,
                                         random_twins)
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.lora.request import LoRARequest
from minivllm.sequence import Sequence
from minivllm.viz.device import engine_kwargs as device_kwargs

NUM_RANDOM_SEQUENCES = 16
NUM_DISTINCT_CHAINS = 500
# Prompts of the engine check: one long shared head (several full blocks), different endings.
SHARED_HEAD = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
               "First Citizen:\nYou are all resolved rather to die than to famish?\n\n")
ENDINGS = ("All:\n", "Second Citizen:\n", "MENENIUS:\n", "All:\nResolved.\n")


# ============================================================================ the hash
def check_hash_block_tokens(hash_fn: Callable) -> None:
    """`hash_fn(parent_block_hash, token_ids, extra_hash=0)`: an int that names a block's tokens
    and, through the parent's hash, every token before them."""
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    h = hash_fn(None, a)
    expect(isinstance(h, int), f"hash_block_tokens(None, {a}) returned {h!r}: expected an int")
    cases = [
        ("the same block hashed twice", hash_fn(None, a), hash_fn(None, tuple(a)), True),
        ("one token differs", hash_fn(None, a), hash_fn(None, (1, 2, 3, 5)), False),
        ("the same tokens in another order", hash_fn(None, a), hash_fn(None, a[::-1]), False),
        ("a first block and the same tokens after a parent (the chain)", hash_fn(None, b), hash_fn(h, b), False),
        ("the same tokens after different parents", hash_fn(hash_fn(None, a), b),
         hash_fn(hash_fn(None, (9, 9, 9, 9)), b), False),
        ("the same chain built twice", hash_fn(hash_fn(None, a), b), hash_fn(hash_fn(None, a), b), True),
        ("the base model and LoRA adapter 1 (extra_hash)", hash_fn(None, a), hash_fn(None, a, 1), False),
        ("LoRA adapters 1 and 2", hash_fn(None, a, 1), hash_fn(None, a, 2), False),
    ]
    for what, x, y, equal in cases:
        expect((x == y) == equal, f"hash_block_tokens, {what}: the two hashes are {x} and {y}; expected them "
               f"{'equal' if equal else 'different'}")
    rng = random.Random(0)
    chains: dict[tuple, int] = {}
    while len(chains) < NUM_DISTINCT_CHAINS:
        blocks = tuple(tuple(rng.randint(0, 9) for _ in range(4)) for _ in range(rng.randint(1, 3)))
        parent = None
        for block in blocks:
            parent = hash_fn(parent, block)
        chains[blocks] = parent
    seen: dict[int, tuple] = {}
    for blocks, value in chains.items():
        expect(value not in seen, f"hash_block_tokens: the chains {seen.get(value)} and {blocks} hash to the "
               f"same value {value}: a cache would serve one's KV for the other")
        seen[value] = blocks
    passed(f"hash_block_tokens: equal content equal, {len(cases) - 2} kinds of difference and "
           f"{NUM_DISTINCT_CHAINS} random chains distinct")


# ============================================================================ the evictor
def _pool_state(allocator) -> dict[str, object]:
    content = lambda b: (b.num_hashed_tokens, b.token_ids)  # noqa: E731
    cached = [b for b in allocator.blocks if allocator.is_cached(b)]
    return {"get_num_free_blocks()": allocator.get_num_free_blocks(),
            "cached blocks (tokens up to its end, its tokens)": sorted(content(b) for b in cached),
            "evictable blocks (cached, ref_count 0)": sorted(content(b) for b in cached if b.ref_count == 0)}


def check_lru_allocator(allocator_cls: type) -> None:
    """`allocator_cls(Device.GPU, block_size, num_blocks, enable_caching=True)`: free keeps a cached
    block in the evictor, incref revives it, allocate evicts the least recently used (deepest
    first among equals), against `BlockAllocator` on the same calls."""
    ref = BlockAllocator(Device.GPU, 2, 5, True)
    lab = allocator_cls(Device.GPU, 2, 5, True)
    log: list[str] = ["a pool of 5 blocks of 2 tokens, caching on"]
    pairs = []  # (the package's block, yours) for each allocate

    def step(what: str, op: Callable) -> None:
        log.append(what)
        op(ref, 0)
        try:
            op(lab, 1)
        except (NotImplementedError, LabCheckFailed):
            raise
        except Exception as exc:
            raise LabCheckFailed(f"after\n{format_steps(log[:-1])}\n{what} raised {type(exc).__name__}: {exc}") from exc
        want, got = _pool_state(ref), _pool_state(lab)
        for key, value in want.items():
            expect(got[key] == value, f"after\n{format_steps(log)}\n{key}: expected {value}, got {got[key]}")

    def allocate(now: int) -> Callable:
        def op(allocator, side):
            block = allocator.allocate(now)
            if side == 0:
                pairs.append([block, None])
            else:
                expect(block.ref_count == 1 and block.block_hash is None and not allocator.is_cached(block),
                       f"after\n{format_steps(log)}\nthe block allocate() returned is {block} with block_hash "
                       f"{block.block_hash}: expected ref_count 1 and no content (an evicted block forgets its hash)")
                pairs[-1][1] = block
        return op

    chain, parent = [], None
    for i, tokens in enumerate(((1, 2), (3, 4), (5, 6))):
        parent = hash_block_tokens(parent, tokens)
        chain.append((parent, tokens, 2 * (i + 1)))
    for i in range(4):
        step(f"allocate block {'abcd'[i]} (time 1)", allocate(1))
    for i, (block_hash, tokens, depth) in enumerate(chain):
        step(f"register block {'abc'[i]} as tokens {tokens}",
             lambda al, side, i=i, h=block_hash, t=tokens, d=depth: al.register(pairs[i][side], h, t, d))
    step("free block d, never cached (time 2)", lambda al, side: al.free(pairs[3][side], 2))
    for i in range(3):
        step(f"free block {'abc'[i]} (time 3)", lambda al, side, i=i: al.free(pairs[i][side], 3))
    got = lab.lookup(chain[1][0], chain[1][1])
    expect(got is pairs[1][1], f"after\n{format_steps(log)}\nlookup of block b's hash returned {got}: a freed cached "
           "block must stay findable until it is evicted")
    step("incref block b, a cache hit (time 4)", lambda al, side: al.incref(pairs[1][side], 1, 4))
    expect(pairs[1][1].ref_count == 1,
           f"after\n{format_steps(log)}\nblock b's ref_count is {pairs[1][1].ref_count}, expected 1")
    step("free block b (time 5)", lambda al, side: al.free(pairs[1][side], 5))
    for now in (6, 6):
        step(f"allocate (time {now}): the free list first", allocate(now))
    step("allocate (time 7): evict a or c, both last used at time 3: the deeper one (c) first", allocate(7))
    step("allocate (time 8): evict the least recently used (a, time 3, not b, time 5)", allocate(8))
    step("allocate (time 9): evict b", allocate(9))
    try:
        lab.allocate(10)
    except OutOfBlocksError:
        pass
    else:
        raise LabCheckFailed(f"after\n{format_steps(log)}\nallocate() with no free and no evictable block returned a "
                             "block: raise OutOfBlocksError")
    step("free the last block allocated", lambda al, side: al.free(pairs[-1][side], 11))
    try:
        lab.free(pairs[-1][1], 12)
    except ValueError:
        pass
    else:
        raise LabCheckFailed("free() of a block whose ref_count is 0 (a double free) passed silently: raise ValueError")
    passed("evictor: cached blocks stay findable after free, incref revives, LRU eviction (deepest first on a tie)")


# ============================================================================ the prefix cache
def check_prefix_cache(cache_cls: type) -> None:
    """`cache_cls(gpu_allocator, block_size)`'s `find` and `register` against `PrefixCache`, both
    over a `BlockAllocator` with caching on, on the same calls (so block numbers agree)."""
    size = 4
    ref_pool, lab_pool = BlockAllocator(Device.GPU, size, 16, True), BlockAllocator(Device.GPU, size, 16, True)
    ref, lab = PrefixCache(ref_pool, size), cache_cls(lab_pool, size)
    tables: dict[str, tuple[list, list]] = {}
    seq_ids = iter(range(10**6))
    log: list[str] = []

    def seq(tokens, lora_int_id: int = 0) -> Sequence:
        lora = LoRARequest(f"adapter{lora_int_id}", lora_int_id, "/adapter") if lora_int_id else None
        return Sequence(next(seq_ids), None, list(tokens), size, lora_request=lora)

    def cached(pool) -> list[int]:
        return [b.block_number for b in pool.blocks if pool.is_cached(b)]

    def register(name: str, tokens, num_computed: int) -> None:
        s = seq(tokens)
        if name not in tables:
            n = -(-len(tokens) // size)
            tables[name] = ([ref_pool.allocate(1) for _ in range(n)], [lab_pool.allocate(1) for _ in range(n)])
        log.append(f"register({name} = {list(tokens)}, num_computed_tokens={num_computed}) "
                   f"with table {[b.block_number for b in tables[name][0]]}")
        ref.register(s, tables[name][0], num_computed)
        lab.register(s, tables[name][1], num_computed)
        got, want = cached(lab_pool), cached(ref_pool)
        expect(got == want, f"after\n{format_steps(log)}\nthe blocks in the cache are {got}, expected {want} "
               f"(missing {sorted(set(want) - set(got))}, not expected {sorted(set(got) - set(want))})")

    def find(what: str, tokens, lora_int_id: int = 0) -> None:
        s = seq(tokens, lora_int_id)
        want = [b.block_number for b in ref.find(s)]
        got = [b.block_number for b in lab.find(s)]
        adapter = ", LoRA adapter 1" if lora_int_id else ""
        expect(got == want, f"after\n{format_steps(log)}\nfind({list(tokens)}{adapter}) "
               f"({what}) returned blocks {got}, expected {want}")

    a = list(range(1, 11))
    register("A", a, len(a))
    find("the same first 8 tokens: both full blocks", a[:8] + [99])
    find("8 tokens: the block holding the last token is never reused", a[:8])
    find("the first block differs, so nothing after it can match", [7, 7, 7, 7] + a[4:8] + [1])
    find("the same tokens for LoRA adapter 1: never the base model's blocks", a[:8] + [99], lora_int_id=1)
    e = list(range(20, 30))
    register("E", e, 5)
    register("E", e, len(e))
    f = e[:4] + a[4:8] + [0]
    register("F", f, len(f))
    find("F's second block has A's second block's tokens after another first block: the chain tells them "
         "apart", f[:8] + [5])
    passed("prefix cache: find stops at the first miss and before the last token, register up to the "
           "computed tokens, chained hashes, LoRA kept apart")


# ============================================================================ the manager
def check_prefix_caching_manager(manager_cls: type) -> None:
    """Your caching block manager (your allocator and prefix cache inside) against
    `BlockSpaceManager(enable_caching=True)`: a shared prefix, eviction, random sequences."""
    twin = Twin(manager_cls, "case 'a second request with the same 8-token head reuses its 2 blocks'",
                num_gpu_blocks=8, enable_caching=True)
    head = [1, 2, 3, 4, 5, 6, 7, 8]
    twin.add(head + [9, 10])
    twin.add(head + [11])
    twin.case = "case 'finished requests leave their blocks cached (evictable), a third request still hits'"
    for group in list(twin.groups):
        twin.free(group.first_seq)
    twin.add(head + [12, 13, 14])
    twin.free(twin.groups[0].first_seq)
    twin.case = "case 'a request that needs 7 of 8 blocks evicts one cached block: the deeper of two equals'"
    twin.free(twin.add([30 + i for i in range(28)]).first_seq)
    twin.case = "case 'after the eviction only the head's first block is still cached'"
    twin.add(head + [15])
    expect(twin.ref.prefix_cache.num_hits == 5, f"{twin.case}: the package's manager had "
           f"{twin.ref.prefix_cache.num_hits} hits, the case expects 5 (the case itself is wrong)")
    passed("shared prefix reused, cached blocks kept after free and evicted when needed")
    random_twins(manager_cls, ALL_OPERATIONS, enable_caching=True, num_sequences=NUM_RANDOM_SEQUENCES)
    passed(f"{NUM_RANDOM_SEQUENCES} random sequences of {NUM_RANDOM_OPS} operations: same tables, cached and "
           "evictable blocks and hit rate as minivllm's BlockSpaceManager")


def counting_evictions(manager_cls: type) -> type:
    """`manager_cls` that records its instances and counts evictions of its GPU pool."""

    class Counting(manager_cls):
        instances: list = []

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.num_evictions = 0
            evict = self.gpu_allocator._evict

            def counted_evict():
                self.num_evictions += 1
                return evict()

            self.gpu_allocator._evict = counted_evict
            Counting.instances.append(self)

    Counting.__name__ = Counting.__qualname__ = f"Counting{manager_cls.__name__}"
    return Counting


def check_prefix_caching_in_engine(manager_cls: type, max_tokens: int = 16) -> None:
    """Your class as `block_manager_cls` with `enable_prefix_caching=True`: prompts sharing a long
    head, twice over one engine whose small pool must evict; greedy output equal to transformers,
    hit rate above 0, evictions above 0, every block free or evictable at the end."""
    cls = counting_evictions(manager_cls)
    llm = LLM(**device_kwargs(block_manager_cls=cls, enable_prefix_caching=True, block_size=8,
                              num_gpu_blocks_override=14, max_model_len=128))
    prompts = [SHARED_HEAD + ending for ending in ENDINGS]
    assert_greedy_matches_transformers(prompts[:2], max_tokens, llm=llm)
    assert_greedy_matches_transformers(prompts[2:] + prompts[:1], max_tokens, llm=llm)
    bm = cls.instances[-1]
    hit_rate = bm.get_prefix_cache_hit_rate()
    expect(hit_rate > 0, f"the prefix-cache hit rate is {hit_rate}: prompts sharing a "
           f"{len(SHARED_HEAD)}-character head found none of its blocks in the cache")
    expect(bm.num_evictions > 0, "the small pool never evicted a cached block, so this run proves nothing "
           "about eviction (the check's engine settings are too generous)")
    assert_all_blocks_free(llm, "prefix caching")
    passed(f"prefix caching in the engine: hit rate {hit_rate:.2f}, {bm.num_evictions} evictions, "
           "every block free or evictable at the end")
