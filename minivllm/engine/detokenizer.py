"""Incremental detokenization: the text of one new token, given the tokens before it.

Mirrors `vllm/transformers_utils/detokenizer.py` (v0). Decoding one token id on its own is
wrong in two common cases:

    - SentencePiece / byte-level BPE marks a leading space on the token ("▁the", "Ġthe")
      that `decode([id])` drops or keeps depending on what precedes it;
    - one character may span several byte tokens (UTF-8 emoji, CJK): the first pieces
      decode to the replacement character "\ufffd" until the last one arrives.

So each step we decode a short window twice, ending before and after the new token(s), and
emit the difference; the window is `Sequence.prefix_offset : ...` and the part already
emitted ends at `Sequence.read_offset` (both indices into prompt + output token ids). When
the text ends in "\ufffd" we wait for more tokens. Cost per token is constant, not
proportional to the sequence length.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

# The window starts this many tokens before the first generated token, so the first
# generated token is decoded with some context (its leading space comes out right).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    """Appends each sequence's new text to `seq.output_text`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode_sequence_inplace(self, seq: Sequence, params: SamplingParams) -> int:
        """Decode the newest token(s) of `seq` into `seq.output_text`; returns new characters."""
        token_ids = seq.get_token_ids()
        if seq.get_output_len() == 1 or seq.read_offset == 0:
            # First generated token: start the window a few prompt tokens back.
            prompt_len = seq.get_prompt_len()
            seq.prefix_offset = max(prompt_len - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
            seq.read_offset = prompt_len
        decode_args = dict(
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        prefix_text = self._decode(token_ids[seq.prefix_offset : seq.read_offset], decode_args)
        full_text = self._decode(token_ids[seq.prefix_offset :], decode_args)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return 0  # nothing printable yet (a special token, or half a character)
        new_text = full_text[len(prefix_text) :]
        seq.output_text += new_text
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(token_ids)
        return len(new_text)

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
