"""`LLM.generate` keeps the objects alive before it out of the GC's scans while the engine
steps (vLLM's `freeze_gc_heap`), and leaves nothing frozen after it."""

import gc
import weakref

import pytest

from minivllm import LLM, SamplingParams


class FreezeProbe:
    """A stat logger: the GC's freeze count at the end of every engine step."""

    def __init__(self) -> None:
        self.counts = []

    def log(self, stats) -> None:
        self.counts.append(gc.get_freeze_count())


@pytest.fixture
def llm():
    gc.unfreeze()
    return LLM(max_model_len=128)


def test_the_heap_is_frozen_while_generate_steps_and_thawed_after(llm):
    probe = FreezeProbe()
    llm.llm_engine.add_logger("probe", probe)
    out = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(temperature=0.0, max_tokens=4))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert probe.counts and all(count > 0 for count in probe.counts)
    assert gc.get_freeze_count() == 0


def test_full_collections_wait_while_generate_steps_and_thresholds_come_back(llm):
    before = gc.get_threshold()
    seen = []
    llm.llm_engine.add_logger("probe", type("Probe", (), {"log": lambda self, stats: seen.append(gc.get_threshold())})())
    llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=4))
    assert seen and all(t[:2] == before[:2] and t[2] > 1_000_000 for t in seen)
    assert gc.get_threshold() == before


class Holder:
    """Something of the caller's that can sit in a reference cycle."""


def test_nothing_of_the_callers_stays_uncollectable():
    """A reference cycle alive when generate starts and dropped after it is collected, and so
    is an LLM in a reference cycle, with its engine."""
    gc.unfreeze()
    llm = LLM(max_model_len=128)
    holder = Holder()
    holder.self = holder
    holder_ref, engine_ref = weakref.ref(holder), weakref.ref(llm.llm_engine)
    llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=2))
    llm.self_reference = llm
    del holder, llm
    gc.collect()
    assert holder_ref() is None
    assert engine_ref() is None


def test_a_heap_the_caller_froze_is_left_frozen(llm):
    gc.freeze()
    try:
        llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=2))
        assert gc.get_freeze_count() > 0  # (frozen objects that die by reference count leave it)
    finally:
        gc.unfreeze()


def test_overlapping_generate_calls_restore_the_thresholds_once_the_last_ends():
    """generate calls of two LLMs in two threads may end in either order: the thresholds
    come back when the last one ends, not before, and not to the paused value."""
    from minivllm.entrypoints.gc_tuning import gc_heap_frozen

    before = gc.get_threshold()
    first, second = gc_heap_frozen(), gc_heap_frozen()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_threshold()[2] > 1_000_000  # the second is still stepping
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
