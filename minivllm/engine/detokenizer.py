"""Incremental detokenization: the text of one new token, given the tokens before it.

Mirrors `vllm/transformers_utils/detokenizer.py` (v0): decode the window
`token_ids[prefix_offset:read_offset]` and the same window with the new token(s), emit the
difference, hold back text ending in "\ufffd" (half a character). A fast tokenizer's
`StreamingDetokenizer` (stream_detokenizer.py) does the same inside `tokenizers`.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

# The window starts this many tokens before the first generated token, so the first
# generated token is decoded with some context (its leading space comes out right).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    """Appends each sequence's new text to `seq.output_text` (the two-`decode` window)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode_sequence_inplace(self, seq: Sequence, params: SamplingParams) -> int:
        """Decode the newest token(s) of `seq` into `seq.output_text`; returns new characters."""
        if seq.get_output_len() == 1 or seq.read_offset == 0:
            self._start_window(seq)
        text_before = len(seq.output_text)
        self._decode_new_tokens(seq, params)
        return len(seq.output_text) - text_before

    def _start_window(self, seq: Sequence) -> None:
        """First generated token: start the window a few prompt tokens back."""
        prompt_len = seq.get_prompt_len()
        seq.prefix_offset = max(prompt_len - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        seq.read_offset = prompt_len

    def _decode_new_tokens(self, seq: Sequence, params: SamplingParams) -> None:
        token_ids = seq.get_token_ids()
        decode_args = dict(skip_special_tokens=params.skip_special_tokens,
                           spaces_between_special_tokens=params.spaces_between_special_tokens)
        prefix_text = self._decode(token_ids[seq.prefix_offset : seq.read_offset], decode_args)
        full_text = self._decode(token_ids[seq.prefix_offset :], decode_args)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return  # nothing printable yet (a special token, or half a character)
        seq.output_text += full_text[len(prefix_text) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(token_ids)

    def _decode(self, token_ids: list[int], decode_args: dict) -> str:
        if not token_ids:
            return ""
        try:
            return self.tokenizer.decode(token_ids, **decode_args)
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return self.tokenizer.decode(token_ids, skip_special_tokens=decode_args["skip_special_tokens"])

    def decode_token(self, token_id: int) -> str:
        """One token's own text (for `Logprob.decoded_token`)."""
        return self.tokenizer.decode([token_id])


def make_detokenizer(tokenizer) -> Detokenizer:
    """A `StreamingDetokenizer` where a `DecodeStream` gives exactly `tokenizer.decode`'s text
    (a fast tokenizer without transformers' clean-up of spaces), else the window's."""
    # Deferred: StreamingDetokenizer subclasses Detokenizer.
    from minivllm.engine.stream_detokenizer import DecodeStream, StreamingDetokenizer

    fast = DecodeStream is not None and getattr(tokenizer, "backend_tokenizer", None) is not None
    if fast and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamingDetokenizer(tokenizer)
    return Detokenizer(tokenizer)
