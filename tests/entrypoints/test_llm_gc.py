"""`LLM` keeps the engine's objects out of the GC's full collections while it lives (vLLM's
`freeze_gc_heap`), and gives them back when it is deleted."""

import gc
import weakref

from minivllm import LLM, SamplingParams


def test_the_engine_is_frozen_while_the_llm_lives_and_collectable_after():
    gc.unfreeze()
    llm = LLM(max_model_len=128)
    engine = weakref.ref(llm.llm_engine)
    assert gc.get_freeze_count() > 0
    # A frozen heap still generates: the collector skips objects, nothing else changes.
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    gc.collect()
    assert engine() is not None
    del llm, out
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine() is None
