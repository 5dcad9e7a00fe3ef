"""The labs' checks (`notebooks/labs/`): a learner's piece, first on focused cases, then inside
a real engine whose greedy output must equal transformers' (`parity.py`).

A check raises `LabCheckFailed` (an AssertionError) with the failing case, expected vs got, so a
lab's check cell fails until the learner's code is right; a skeleton's `NotImplementedError`
propagates as it is. One module per lab; the extension points they plug into: docs/labs.md.
"""

from __future__ import annotations

import torch


class LabCheckFailed(AssertionError):
    """One failing case, with the message the learner reads."""


def expect(ok: bool, message: str) -> None:
    """Fail the check with `message` unless `ok`."""
    if not ok:
        raise LabCheckFailed(message)


def expect_yours(built, cls: type, what: str, hint: str = "") -> None:
    """Fail the check unless the engine built the learner's `cls` as `what` (e.g. "the engine's
    scheduler"); `hint` says where the learner's code must install it."""
    expect(isinstance(built, cls), f"{what} is a {type(built).__name__}, not your {cls.__name__}"
                                   + (f": {hint}" if hint else ""))


def expect_tensor(got, shape, dtype: torch.dtype | None = None, *, what: str) -> None:
    """Fail the check unless `got` is a tensor of `shape` (and `dtype`, when given); `what`
    names the call, e.g. "case 'greedy': kept_mask"."""
    want = _describe(shape, dtype)
    if not isinstance(got, torch.Tensor):
        raise LabCheckFailed(f"{what} returned {type(got).__name__}, expected {want}")
    expect(list(got.shape) == list(shape) and (dtype is None or got.dtype == dtype),
           f"{what} returned {_describe(got.shape, got.dtype)}, expected {want}")


def _describe(shape, dtype: torch.dtype | None) -> str:
    dtype_part = "" if dtype is None else f" and dtype {str(dtype).removeprefix('torch.')}"
    return f"a tensor of shape {list(shape)}{dtype_part}"


def passed(message: str) -> None:
    """Print the line a learner sees for a passed check: "✓ message"."""
    print(f"✓ {message}")
