"""A fast tokenizer's incremental detokenization: one `tokenizers` `DecodeStream` per sequence.

vLLM v1's `FastIncrementalDetokenizer` (`vllm/v1/engine/detokenizer.py`): the window
algorithm of `detokenizer.py` inside `tokenizers`, a few times cheaper per token than two
`decode` calls. `make_detokenizer` picks it where its text equals `tokenizer.decode`'s.
"""

from __future__ import annotations

from minivllm.engine.detokenizer import REPLACEMENT_CHAR, Detokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: every sequence takes the window path
    DecodeStream = None


class StreamingDetokenizer(Detokenizer):
    """The same text through one `DecodeStream` per sequence. The offsets stay up to date, so
    the window takes over when a stream cannot start or refuses a token, and a stream can be
    rebuilt from them (after a fork)."""

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
            except Exception:  # refused: the window decodes the rest, the next token rebuilds it
                seq.decode_stream = None
        super()._decode_new_tokens(seq, params)

    def _start_stream(self, seq: Sequence, params: SamplingParams) -> bool:
        """A stream primed with the offsets' window, so it decodes as the window would; none
        while the window ends mid-character (the stream would emit the window's own bytes)."""
        window = seq.get_token_ids()[seq.prefix_offset : seq.read_offset]
        if self.backend.decode(window, skip_special_tokens=params.skip_special_tokens).endswith(REPLACEMENT_CHAR):
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
