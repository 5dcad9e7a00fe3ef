"""The labs' checks (`notebooks/labs/`): a learner's piece, first on focused cases, then inside
a real engine whose greedy output must equal transformers' (`parity.py`).

A check raises `LabCheckFailed` (an AssertionError) with the failing case, expected vs got, so a
lab's check cell fails until the learner's code is right; a skeleton's `NotImplementedError`
propagates as it is. One module per lab; the extension points they plug into: docs/labs.md.
"""

from __future__ import annotations


class LabCheckFailed(AssertionError):
    """One failing case, with the message the learner reads."""


def expect(ok: bool, message: str) -> None:
    """Fail the check with `message` unless `ok`."""
    if not ok:
        raise LabCheckFailed(message)


def passed(message: str) -> None:
    print(f"✓ {message}")
