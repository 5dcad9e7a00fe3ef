"""A request's prompt as token ids, checked against the model: `process_prompt`.

Mirrors `vllm/inputs/preprocess.py` (v0's `InputPreprocessor`: text or token ids in, token
ids out). Every check raises `InvalidParameterError` (a ValueError) naming the field.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from minivllm.sampling_params import InvalidParameterError

PromptInput = str | dict[str, Any]


def process_prompt(prompt: PromptInput, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a string or a `{"prompt_token_ids": [...], "prompt": text}`."""
    if isinstance(prompt, str) and tokenizer is None:
        raise InvalidParameterError("prompt", "skip_tokenizer_init is set: give {'prompt_token_ids': [...]}, not text.")
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if text is not None and not isinstance(text, str):
            raise InvalidParameterError("prompt", f"the prompt's text must be a string, got {text!r}.")
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
            raise InvalidParameterError("prompt_token_ids", f"prompt_token_ids must be a list, got {token_ids!r}.")
        token_ids = list(token_ids)
    else:
        raise InvalidParameterError("prompt", f"prompt must be a string or a dict with 'prompt_token_ids', got {prompt!r:.200}.")
    if not token_ids:
        raise InvalidParameterError("prompt", "the prompt is empty: give at least one token.")
    return text, check_token_ids("prompt", token_ids, vocab_size)


def check_token_ids(name: str, ids: list, vocab_size: int) -> list[int]:
    """`ids` as plain ints; each must index the embedding table (and the logits), or a step fails."""
    if all(type(t) is int for t in ids) and 0 <= min(ids, default=0) <= max(ids, default=0) < vocab_size:
        return ids  # plain ints, the usual prompt: checked at C speed
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError(name, f"{name} must be token ids, integers in [0, {vocab_size}), got {bad[:5]}.")
    return [int(t) for t in ids]
