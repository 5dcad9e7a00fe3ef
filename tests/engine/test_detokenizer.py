"""Incremental detokenization equals decoding the whole output at once (the tokenizer's own
`decode` is the reference), for a byte-level BPE (the bundled model's) and a character one."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from minivllm.bundled_models import resolve_model
from minivllm.engine.detokenizer import Detokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

TOKENIZERS = {
    "bundled-byte-bpe": AutoTokenizer.from_pretrained(resolve_model(None)),
    "characters": checkpoints.build_tokenizer(),
}


def stream(tokenizer, prompt: str, continuation: str) -> tuple[str, list[str]]:
    """Feed the continuation's tokens one by one; return the final text and each step's delta."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(prompt + continuation, add_special_tokens=False)[len(prompt_ids):]
    seq = Sequence(0, prompt, prompt_ids, block_size=16)
    detokenizer, params = Detokenizer(tokenizer), SamplingParams()
    deltas = []
    for token in output_ids:
        seq.append_token_id(token, {token: 0.0})
        before = seq.output_text
        detokenizer.decode_sequence_inplace(seq, params)
        deltas.append(seq.output_text[len(before):])
    return seq.output_text, tokenizer.decode(output_ids, skip_special_tokens=True), deltas


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("continuation", [" thou art", "\nROMEO: O, she doth teach the torches!", "  two  spaces"])
def test_incremental_text_equals_full_decode(name, continuation):
    text, expected, _ = stream(TOKENIZERS[name], "ROMEO:", continuation)
    assert text == expected


def test_multibyte_characters_wait_for_their_last_byte():
    """A byte-level BPE splits "é" and emoji across tokens: no half character is ever emitted."""
    text, expected, deltas = stream(TOKENIZERS["bundled-byte-bpe"], "Say", " café 🌍 naïve")
    assert text == expected == " café 🌍 naïve"
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x1F64F, exclude_categories=("Cs",)),
               min_size=1, max_size=20))
def test_any_text_streams_back_exactly(continuation):
    text, expected, _ = stream(TOKENIZERS["bundled-byte-bpe"], "KING:", continuation)
    assert text == expected
