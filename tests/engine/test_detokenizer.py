"""Incremental detokenization equals decoding the whole output at once (the tokenizer's own
`decode` is the reference), for a byte-level BPE (the bundled model's) and a character one,
on both paths: a fast tokenizer's `DecodeStream` and the two-`decode` window."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from minivllm.bundled_models import resolve_model
from minivllm.engine.detokenizer import Detokenizer, make_detokenizer
from minivllm.engine.stream_detokenizer import StreamingDetokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

TOKENIZERS = {
    "bundled-byte-bpe": AutoTokenizer.from_pretrained(resolve_model(None)),
    "characters": checkpoints.build_tokenizer(),
}


PATHS = {"decode-stream": True, "window": False}


def detokenizer_for(tokenizer, use_decode_stream: bool) -> Detokenizer:
    """The engine's choice for this tokenizer, or the plain window."""
    return make_detokenizer(tokenizer) if use_decode_stream else Detokenizer(tokenizer)


def stream(tokenizer, prompt: str, continuation: str, use_decode_stream: bool = True,
           fork_at: int | None = None) -> tuple[str, str, list[str]]:
    """Feed the continuation's tokens one by one; return the final text, the whole output
    decoded at once, and each step's delta. `fork_at`: continue in a fork from that token on."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(prompt + continuation, add_special_tokens=False)[len(prompt_ids):]
    seq = Sequence(0, prompt, prompt_ids, block_size=16)
    detokenizer, params = detokenizer_for(tokenizer, use_decode_stream), SamplingParams()
    assert isinstance(detokenizer, StreamingDetokenizer) == use_decode_stream
    deltas = []
    for i, token in enumerate(output_ids):
        if i == fork_at:
            seq = seq.fork(1)
        seq.append_token_id(token, {token: 0.0})
        before = seq.output_text
        detokenizer.decode_sequence_inplace(seq, params)
        deltas.append(seq.output_text[len(before):])
    return seq.output_text, tokenizer.decode(output_ids, skip_special_tokens=True), deltas


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("continuation", [" thou art", "\nROMEO: O, she doth teach the torches!", "  two  spaces"])
def test_incremental_text_equals_full_decode(name, continuation, path):
    text, expected, _ = stream(TOKENIZERS[name], "ROMEO:", continuation, PATHS[path])
    assert text == expected


@pytest.mark.parametrize("path", sorted(PATHS))
def test_multibyte_characters_wait_for_their_last_byte(path):
    """A byte-level BPE splits "é" and emoji across tokens: no half character is ever emitted."""
    text, expected, deltas = stream(TOKENIZERS["bundled-byte-bpe"], "Say", " café 🌍 naïve", PATHS[path])
    assert text == expected == " café 🌍 naïve"
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x1F64F, exclude_categories=("Cs",)),
               min_size=1, max_size=20), st.sampled_from(sorted(PATHS)))
def test_any_text_streams_back_exactly(continuation, path):
    text, expected, _ = stream(TOKENIZERS["bundled-byte-bpe"], "KING:", continuation, PATHS[path])
    assert text == expected


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x1F64F, exclude_categories=("Cs",)),
               min_size=2, max_size=16), st.integers(1, 12))
def test_a_fork_rebuilds_its_stream_and_goes_on_exactly(continuation, fork_at):
    """A stream cannot be copied: a forked sequence (beam search, n > 1) primes a new one
    from the offsets, even in the middle of a multi-byte character."""
    text, expected, _ = stream(TOKENIZERS["bundled-byte-bpe"], "KING:", continuation, fork_at=fork_at)
    assert text == expected


def test_a_token_the_stream_refuses_falls_back_to_the_window(monkeypatch):
    """If `DecodeStream.step` raises, that token is decoded the window's way and the next
    token builds a fresh stream: the text is still exactly the full decode."""
    import minivllm.engine.stream_detokenizer as module

    calls, real_stream = {"n": 0}, module.DecodeStream

    class FlakyStream:  # the real stream, refusing every 3rd step
        def __init__(self, **kwargs):
            self.real = real_stream(**kwargs)

        def step(self, backend, token_id):
            calls["n"] += 1
            if calls["n"] % 3 == 0:
                raise RuntimeError("refused")
            return self.real.step(backend, token_id)

    monkeypatch.setattr(module, "DecodeStream", FlakyStream)
    text, expected, deltas = stream(TOKENIZERS["bundled-byte-bpe"], "KING:", " long live the king, café 🌍")
    assert calls["n"] > 6
    assert text == expected and all("\ufffd" not in delta for delta in deltas)


def test_clean_up_of_spaces_keeps_the_window():
    """transformers' `clean_up_tokenization_spaces` rewrites decoded text; a stream would not."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None), clean_up_tokenization_spaces=True)
    assert not isinstance(make_detokenizer(tokenizer), StreamingDetokenizer)
    assert isinstance(make_detokenizer(TOKENIZERS["bundled-byte-bpe"]), StreamingDetokenizer)


def continue_from_ids(tokenizer, ids: list[int], cut: int, use_decode_stream: bool) -> str:
    """Generation continuing a prompt of token ids `ids[:cut]` with `ids[cut:]`."""
    seq = Sequence(0, None, ids[:cut], block_size=16)
    detokenizer = detokenizer_for(tokenizer, use_decode_stream)
    for token in ids[cut:]:
        seq.append_token_id(token, {token: 0.0})
        detokenizer.decode_sequence_inplace(seq, SamplingParams())
    return seq.output_text


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x1F64F, exclude_categories=("Cs",)),
               min_size=1, max_size=12), st.integers(1, 30))
def test_a_prompt_cut_inside_a_character_decodes_as_the_window_does(text, cut):
    """Token-id prompts can end inside a multi-byte character; the stream then starts only
    at a character boundary, and never emits the prompt's own bytes."""
    tokenizer = TOKENIZERS["bundled-byte-bpe"]
    ids = tokenizer.encode("a" + text + " and more", add_special_tokens=False)
    cut = min(cut, len(ids) - 1)
    assert continue_from_ids(tokenizer, ids, cut, True) == continue_from_ids(tokenizer, ids, cut, False)


def test_the_hieroglyph_prompt_keeps_its_bytes():
    tokenizer = TOKENIZERS["bundled-byte-bpe"]
    ids = tokenizer.encode("a𓀀𓀁𓀂𓀃 world and more", add_special_tokens=False)
    for cut in range(1, 10):
        text = continue_from_ids(tokenizer, ids, cut, True)
        assert text == continue_from_ids(tokenizer, ids, cut, False)
        assert "\ufffd" not in text
