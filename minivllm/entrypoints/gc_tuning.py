"""Keep Python's garbage collector out of `LLM.generate`'s engine steps.

The model, torch and transformers are some 300k long-lived Python objects; a full collection
scans them all and stalls the step it lands in. `gc_heap_frozen()`, around the step loop:
- freezes the objects alive now (`gc.freeze`), so no collection scans them, as vLLM's
  `freeze_gc_heap` does once the model is warm; here the freeze lasts one `generate`, so
  nothing of the caller's stays uncollectable after it. A heap the caller froze is left as is.
- holds off automatic full collections (the third threshold) until the run ends; young
  generations are still collected, and the few cycles a run makes are collected after it.
Overlapping calls (several `LLM`s in threads) nest: the first in pauses, the last out restores.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# Young-generation collections between two full ones: in effect never, during one generate.
_NO_AUTOMATIC_FULL_COLLECTION = 1_000_000_000

_lock = threading.Lock()
_calls_inside = 0
_thresholds_before: tuple[int, int, int] | None = None  # set by the first call in


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[None]:
    """Freeze the heap and pause full collections for the duration of the `with` block."""
    global _calls_inside, _thresholds_before
    with _lock:
        if _calls_inside == 0:
            _thresholds_before = gc.get_threshold()
            gc.set_threshold(_thresholds_before[0], _thresholds_before[1], _NO_AUTOMATIC_FULL_COLLECTION)
        _calls_inside += 1
        frozen_here = not gc.get_freeze_count()
        if frozen_here:
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            if frozen_here:
                gc.unfreeze()
            _calls_inside -= 1
            if _calls_inside == 0:
                gc.set_threshold(*_thresholds_before)
