"""Models that ship inside the package, so minivllm runs offline on a fresh machine.

`resolve_model(None)` and `resolve_model("tiny-shakespeare")` give the bundled checkpoint's
folder, `resolve_model("tiny-shakespeare-draft")` its speculative-decoding draft's; any other
name (a local directory or a Hugging Face hub id) passes through unchanged for transformers to
resolve.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "tiny-shakespeare"
# A 6x smaller model with the same tokenizer, distilled from tiny-shakespeare: the draft model
# of speculative decoding (`speculative_model="tiny-shakespeare-draft"`).
DRAFT_MODEL = "tiny-shakespeare-draft"
BUNDLED_MODELS = {name: Path(__file__).parent / name for name in (DEFAULT_MODEL, DRAFT_MODEL)}


def resolve_model(model: str | None) -> str:
    """Map `None` or a bundled model's name to its folder; leave other names as they are."""
    name = DEFAULT_MODEL if model is None else model
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a non-empty string or None, got {model!r}.")
    path = BUNDLED_MODELS.get(name)
    return str(path) if path is not None else name
