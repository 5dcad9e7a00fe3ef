"""Incremental detokenization: the text of one new token, given the tokens before it.

Mirrors `vllm/transformers_utils/detokenizer.py` (v0). Decoding one token id alone is wrong
when a tokenizer marks a leading space on the token ("▁the", "Ġthe") or one character spans
several byte tokens (the first pieces decode to "\ufffd" until the last one arrives).

So each step decodes a short window twice, ending before and after the new token(s), and
emits the difference: the window starts at `Sequence.prefix_offset`, the text already emitted
ends at `Sequence.read_offset` (indices into prompt + output token ids); text ending in
"\ufffd" waits for more tokens. The cost per token is constant, not in the sequence's length.

With a fast (Rust) tokenizer `make_detokenizer` picks `StreamingDetokenizer`: the same
algorithm inside `tokenizers`, one `DecodeStream` per sequence (vLLM v1's
`FastIncrementalDetokenizer`), a few times cheaper per token than two `decode` calls. The
offsets stay up to date on both paths, so a stream can be rebuilt from them (after a fork, or
if the stream refuses a token).
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: every sequence takes the window path
    DecodeStream = None

# The window starts this many tokens before the first generated token, so the first
# generated token is decoded with some context (its leading space comes out right).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


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
        decode_args = dict(
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        prefix_text = self._decode(token_ids[seq.prefix_offset : seq.read_offset], decode_args)
        full_text = self._decode(token_ids[seq.prefix_offset :], decode_args)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
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


class StreamingDetokenizer(Detokenizer):
    """The same text through one `tokenizers` `DecodeStream` per sequence (a fast tokenizer
    whose decoding equals transformers'; `make_detokenizer` decides). The window's offsets
    stay up to date, so the window takes over whenever a stream cannot start or refuses a
    token, and a stream can always be rebuilt from them (after a fork, for one)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.backend = tokenizer.backend_tokenizer

    def _start_window(self, seq: Sequence) -> None:
        super()._start_window(seq)
        seq.decode_stream = None

    def _decode_new_tokens(self, seq: Sequence, params: SamplingParams) -> None:
        if seq.decode_stream is not None or self._start_stream(seq, params):
            try:
                self._feed_stream(seq)
                return
            except Exception:  # a token the stream refuses: the window decodes the rest, the next token rebuilds it
                seq.decode_stream = None
        super()._decode_new_tokens(seq, params)

    def _start_stream(self, seq: Sequence, params: SamplingParams) -> bool:
        """A stream primed with the window the offsets describe, so that it decodes exactly as
        the window would. Not when the window ends inside a character (a prompt cut
        mid-character): the stream would emit the window's own bytes; the window decodes
        this token, and a later one starts the stream at a character boundary."""
        window = seq.get_token_ids()[seq.prefix_offset : seq.read_offset]
        if self.backend.decode(window, skip_special_tokens=params.skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            return False
        seq.decode_stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        for token_id in window:  # already emitted: only the context matters
            seq.decode_stream.step(self.backend, token_id)
        seq.stream_fed = seq.read_offset - seq.get_prompt_len()  # output tokens the stream has seen
        return True

    def _feed_stream(self, seq: Sequence) -> None:
        """Feed the stream the output tokens it has not seen."""
        output_ids = seq.data.output_token_ids
        prompt_len = seq.get_prompt_len()
        for i in range(seq.stream_fed, len(output_ids)):
            chunk = seq.decode_stream.step(self.backend, output_ids[i])
            seq.stream_fed = i + 1
            if chunk:  # None: half a character, held back until its last byte
                seq.output_text += chunk
                seq.prefix_offset, seq.read_offset = seq.read_offset, prompt_len + i + 1


def make_detokenizer(tokenizer) -> Detokenizer:
    """A `StreamingDetokenizer` where a `DecodeStream` gives exactly `tokenizer.decode`'s text
    (a fast tokenizer without transformers' clean-up of spaces), else the window's."""
    fast = DecodeStream is not None and getattr(tokenizer, "backend_tokenizer", None) is not None
    if fast and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamingDetokenizer(tokenizer)
    return Detokenizer(tokenizer)
