"""LoRA in the scheduler and the block manager: at most `max_loras` distinct adapters among the
running groups (so in any batch), a group passed over keeps its place, and the prefix-cache
hash includes the adapter (the same tokens under two adapters never share a block)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.config import CacheConfig, LoRAConfig, SchedulerConfig
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.core.scheduler import Scheduler
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4
TOKEN = 7
_seq_ids = itertools.count()


def lora(lora_id: int) -> LoRARequest | None:
    return LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None


def make_group(request_id: str, prompt: list[int], lora_id: int, max_tokens: int = 3, arrival: float = 0.0):
    seq = Sequence(next(_seq_ids), None, prompt, BLOCK_SIZE, lora_request=lora(lora_id))
    return SequenceGroup(request_id, [seq], arrival, SamplingParams(max_tokens=max_tokens), lora_request=lora(lora_id))


def run_model(scheduler: Scheduler, outputs) -> None:
    for scheduled in outputs.scheduled_seq_groups:
        group = scheduled.seq_group
        group.update_num_computed_tokens(scheduled.token_chunk_size)
        for seq in group.get_seqs(status=SequenceStatus.RUNNING):
            if seq.get_num_uncomputed_tokens():
                continue
            seq.append_token_id(TOKEN, {TOKEN: 0.0})
            if seq.get_output_len() >= group.sampling_params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    scheduler.free_finished_seq_groups()


@settings(max_examples=40, deadline=None)
@given(loras=st.lists(st.integers(0, 4), min_size=1, max_size=12), max_loras=st.integers(1, 3),
       chunked=st.booleans(), num_gpu_blocks=st.integers(8, 40))
def test_never_more_than_max_loras_adapters_running(loras, max_loras, chunked, num_gpu_blocks):
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=64,
                                          enable_chunked_prefill=chunked),
                          CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=40),
                          LoRAConfig(max_loras=max_loras))
    for i, lora_id in enumerate(loras):
        scheduler.add_seq_group(make_group(str(i), [3 + i % 5] * (3 + i % 9), lora_id, arrival=float(i)))
    for _ in range(500):
        if not scheduler.has_unfinished_seqs():
            break
        metadata, outputs, _ = scheduler.schedule()
        in_batch = {m.lora_int_id for m in metadata} - {0}
        running = {g.lora_int_id for g in scheduler.running} - {0}
        assert len(in_batch) <= max_loras and len(running) <= max_loras
        assert all(m.lora_request == g.seq_group.lora_request for m, g in zip(metadata, outputs.scheduled_seq_groups))
        run_model(scheduler, outputs)
    assert not scheduler.has_unfinished_seqs()  # every request finished: nobody starves


def test_a_group_passed_over_keeps_its_place():
    """max_loras=1 and adapter 1 running: adapter 2's request waits, the base-model request
    behind it goes first, and adapter 2 is next once adapter 1 is done."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=64),
                          CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=32), LoRAConfig(max_loras=1))
    for request_id, lora_id in (("one", 1), ("two", 2), ("base", 0), ("one-more", 1)):
        scheduler.add_seq_group(make_group(request_id, [5, 6, 7], lora_id, max_tokens=2))
    metadata, outputs, _ = scheduler.schedule()
    assert [m.request_id for m in metadata] == ["one", "base", "one-more"]
    assert [g.request_id for g in scheduler.waiting] == ["two"]
    batches = []
    while scheduler.has_unfinished_seqs():
        run_model(scheduler, outputs)
        metadata, outputs, _ = scheduler.schedule()
        batches.append({m.request_id for m in metadata})
    first_two = next(i for i, b in enumerate(batches) if "two" in b)
    assert all(not b & {"one", "one-more"} for b in batches[first_two:])  # adapter 1 was done
    assert all(b & {"one", "one-more"} for b in batches[:first_two - 1])  # ...and "two" came right after


def test_prefix_cache_hash_includes_the_adapter():
    manager = BlockSpaceManager(block_size=BLOCK_SIZE, num_gpu_blocks=16, num_cpu_blocks=0, enable_caching=True)
    prompt = list(range(10, 19))  # two full blocks and one token
    groups = {}
    for request_id, lora_id in (("a1", 1), ("base", 0), ("a2", 2), ("a1-again", 1), ("base-again", 0)):
        group = groups[request_id] = make_group(request_id, prompt, lora_id)
        seq = group.first_seq
        cached = manager.get_num_cached_tokens(seq)
        manager.allocate(group)
        seq.data.update_num_computed_tokens(len(prompt))
        manager.mark_blocks_as_computed(group, len(prompt))
        groups[request_id] = (cached, manager.get_block_table(seq)[:2])
    assert {k: v[0] for k, v in groups.items()} == {"a1": 0, "base": 0, "a2": 0, "a1-again": 8, "base-again": 8}
    assert groups["a1-again"][1] == groups["a1"][1] and groups["base-again"][1] == groups["base"][1]
    assert len({tuple(groups[k][1]) for k in ("a1", "base", "a2")}) == 3  # no block shared across adapters
