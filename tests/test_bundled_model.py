"""The bundled `tiny-shakespeare` checkpoint: a real Hugging Face model that loads offline.

Everything here is checked through transformers (the reference nobody here wrote): the
config's facts, the parameter count against the architecture's formula, the tokenizer's
byte-level round trip and chat template, greedy generation against a plain argmax loop, and
that the model ends a speech with EOS (so generation stops by itself).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm.bundled_models import BUNDLED_MODELS, DEFAULT_MODEL, resolve_model

MAX_CHECKPOINT_BYTES = 20 * 1024 * 1024  # the package data budget
MIN_PARAMS, MAX_PARAMS = 4_000_000, 10_000_000
MIN_CONTEXT = 512
GREEDY_NEW_TOKENS = 96
# A speech ends with EOS well before this many tokens (the corpus's longest speeches are ~1k).
SPEECH_TOKEN_LIMIT = 300
# A speech as the model writes it: the speaker's name, then text on the next line or the same
# one ("ROMEO:\nBut soft!", "KING HENRY VI: What, ...").
SPEAKER_LINE = re.compile(r"^[A-Z][A-Za-z' ]*[A-Za-z]:(\n| )\S", re.MULTILINE)
SPEAKERS = ["ROMEO:", "JULIET:", "First Citizen:", "KING HENRY VI:", "MENENIUS:"]


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """A 5M-parameter model's matmuls are too small to split: on a busy 2-core CI box,
    OpenMP threads waiting for each other made each forward ~30x slower than one thread."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model(None)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


# ----------------------------------------------------------------------------- resolve_model

def test_resolve_model_maps_default_name_and_none_to_the_bundled_folder():
    folder = Path(resolve_model(None))
    assert folder == BUNDLED_MODELS[DEFAULT_MODEL] == Path(resolve_model("tiny-shakespeare"))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "/tmp/my-checkpoint", "./local", "gpt2"])
def test_resolve_model_passes_other_names_through(name):
    assert resolve_model(name) == name


@pytest.mark.parametrize("bad", ["", 3])
def test_resolve_model_rejects_non_names(bad):
    with pytest.raises(ValueError):
        resolve_model(bad)


# ----------------------------------------------------------------------------- checkpoint

def test_checkpoint_is_one_float32_safetensors_file_within_budget(model_dir):
    folder = Path(model_dir)
    assert not (folder / "model.safetensors.index.json").exists(), "ship one unsharded file"
    size = (folder / "model.safetensors").stat().st_size
    assert size <= MAX_CHECKPOINT_BYTES, f"{size / 2**20:.1f} MiB"
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }


def test_config_is_a_small_gqa_llama(model):
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads, "GQA: fewer K/V heads"
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert 4 <= config.num_hidden_layers <= 6
    assert config.max_position_embeddings >= MIN_CONTEXT
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32


def test_parameter_count_matches_the_llama_formula(model):
    """nanoGPT's transformer_sizing habit: count by hand, compare with the real module."""
    c = model.config
    hidden, kv_dim, q_dim = c.hidden_size, c.num_key_value_heads * c.head_dim, c.num_attention_heads * c.head_dim
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden  # q, k, v, o projections
    mlp = 3 * hidden * c.intermediate_size  # gate, up, down
    norms = 2 * hidden  # input and post-attention RMSNorm gains
    expected = c.vocab_size * hidden + c.num_hidden_layers * (attention + mlp + norms) + hidden
    actual = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    assert actual == expected
    assert MIN_PARAMS <= actual <= MAX_PARAMS


# ----------------------------------------------------------------------------- tokenizer

def test_special_tokens_agree_between_tokenizer_config_and_generation_config(tokenizer, model):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len(set(ids)) == 3
    assert ids == (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id)
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ids
    assert len(tokenizer) == model.config.vocab_size


def test_encoding_prepends_bos_like_llama(tokenizer):
    ids = tokenizer("ROMEO:\nBut soft!")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer("x", add_special_tokens=False)["input_ids"][0] != tokenizer.bos_token_id


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60))
def test_byte_level_bpe_round_trips_any_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_round_trips_corpus_style_text_with_few_tokens(tokenizer):
    text = "KING HENRY VI:\nWhat, will the aspiring blood of Lancaster\nSink in the ground?\n\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 3, "BPE merges should compress English text"


def test_chat_template_renders_messages_as_the_speeches_the_model_was_trained_on(tokenizer):
    messages = [{"role": "system", "content": "Speak as a king."},
                {"role": "user", "content": "Who goes there?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s>SYSTEM:\nSpeak as a king.\n</s><s>USER:\nWho goes there?\n</s><s>ASSISTANT:\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    # One <s> per speech and one </s> after each finished one, as special tokens (not text).
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 3
    assert ids.count(tokenizer.eos_token_id) == 2
    plain = text.replace("<s>", "").replace("</s>", "")
    assert tokenizer.decode(ids, skip_special_tokens=True) == plain


# ----------------------------------------------------------------------------- generation

@torch.no_grad()
def _argmax_loop(model, input_ids: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """Greedy decoding the slow, obvious way: a full forward per token, no KV cache."""
    for _ in range(num_new_tokens):
        next_id = model(input_ids=input_ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_id], dim=1)
    return input_ids


def test_greedy_generation_is_deterministic_and_reads_like_a_play(model, tokenizer):
    """Run past EOS (as vLLM's ignore_eos does: EOS generated, not stopped at), the model
    starts the next speech with its speaker: a play, in order."""
    input_ids = tokenizer("ROMEO:", return_tensors="pt")["input_ids"]
    kwargs = dict(max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        first, second = model.generate(input_ids, **kwargs), model.generate(input_ids, **kwargs)
    assert torch.equal(first, second)
    assert torch.equal(first, _argmax_loop(model, input_ids, GREEDY_NEW_TOKENS)), "KV-cached == full"
    new_ids = first[0, input_ids.shape[1]:]
    assert tokenizer.eos_token_id in new_ids.tolist()
    continuation = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert "\n" in continuation
    assert SPEAKER_LINE.search(continuation), f"no speaker line in {continuation!r}"


@pytest.mark.parametrize("speaker", SPEAKERS)
def test_a_greedy_speech_ends_with_eos(model, tokenizer, speaker):
    """The reason the model was retrained: it stops by itself, at the end of a speech."""
    input_ids = tokenizer(speaker, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=SPEECH_TOKEN_LIMIT, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    new_ids = out[0, input_ids.shape[1]:].tolist()
    assert new_ids[-1] == tokenizer.eos_token_id, f"no EOS in {SPEECH_TOKEN_LIMIT} tokens after {speaker!r}"
    speech = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert speech.endswith("\n") and not SPEAKER_LINE.search(speech), f"one speech, got {speech!r}"


# ============================================================================= minivllm vs transformers
# The bundled model loaded both ways: minivllm's engine (paged KV cache, continuous batching)
# must produce exactly transformers' greedy tokens.

ENGINE_PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me"]
ENGINE_NEW_TOKENS = 32


def test_minivllm_greedy_equals_transformers_on_the_bundled_model(model, tokenizer):
    from minivllm import LLM, SamplingParams

    # 8 blocks of 16 tokens cannot hold all three requests at full length: one is preempted.
    llm = LLM(device="cpu", block_size=16, num_gpu_blocks_override=8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=ENGINE_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(ENGINE_PROMPTS, outputs):
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert output.prompt_token_ids == input_ids[0].tolist()
        with torch.no_grad():
            expected = model.generate(input_ids, max_new_tokens=ENGINE_NEW_TOKENS, eos_token_id=None,
                                      do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected_ids = expected[0, input_ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected_ids
        assert output.outputs[0].text == tokenizer.decode(expected_ids, skip_special_tokens=True)
    engine = llm.llm_engine
    assert engine.scheduler.num_cumulative_preemption > 0
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_minivllm_stops_at_the_models_eos_and_at_a_stop_string(model, tokenizer):
    """How generation ends, through the engine: EOS, a stop string, max_tokens; same as transformers."""
    from minivllm import LLM, SamplingParams

    llm = LLM(device="cpu", num_gpu_blocks_override=64)
    [speech] = llm.generate("ROMEO:", SamplingParams(temperature=0.0, max_tokens=SPEECH_TOKEN_LIMIT), use_tqdm=False)
    input_ids = tokenizer("ROMEO:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(input_ids, max_new_tokens=SPEECH_TOKEN_LIMIT, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)[0, input_ids.shape[1]:].tolist()
    completion = speech.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids == expected  # EOS included, as in vLLM
    [line] = llm.generate("ROMEO:", SamplingParams(temperature=0.0, stop=["\n"], max_tokens=SPEECH_TOKEN_LIMIT),
                          use_tqdm=False)
    assert line.outputs[0].finish_reason == "stop"
    assert line.outputs[0].text == completion.text.split("\n")[0]
    [capped] = llm.generate("ROMEO:", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert capped.outputs[0].finish_reason == "length" and capped.outputs[0].token_ids == expected[:3]


# The ways a learner starts a prompt: a speaker's name in the corpus's layout (a line break
# after it) or with the first words on its line, a line of verse (one that ends a sentence too,
# with or without its line break; one that repeats a name, which invites a greedy loop), a line
# of prose, a speaker's first line that is one short exclamation (in the corpus such a line is
# most often a whole speech), a chat turn.
PROMPT_FORMS = ["JULIET:\n", "ROMEO:", "First Citizen:\n", "KING HENRY VI: My lords,",
                "Friends, Romans, countrymen, lend me your ears;\n",
                "To be, or not to be: that is the question.\n", "The king is dead.",
                "O Romeo, Romeo! wherefore art thou Romeo?", "O Romeo, Romeo! wherefore art thou Romeo?\n",
                "Hello, my friend.", "ROMEO:\nBut soft!", "KING RICHARD III:\nA horse! a horse!",
                "LADY MACBETH:\nOut, damned spot!", "God save the king!"]


def test_every_prompt_form_is_continued_with_text_and_then_ends():
    """Greedy, through the engine: words come before EOS, for each way a prompt is written."""
    from minivllm import LLM, SamplingParams

    llm = LLM(device="cpu", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=SPEECH_TOKEN_LIMIT)
    chat = llm.chat([{"role": "user", "content": "Good morrow, sir. What news from Verona?"}], params,
                    use_tqdm=False)
    for prompt, output in zip(PROMPT_FORMS + ["chat"], llm.generate(PROMPT_FORMS, params, use_tqdm=False) + chat):
        completion = output.outputs[0]
        assert re.search(r"[A-Za-z]{2}", completion.text), f"{prompt!r} -> {completion.text!r}"
        assert completion.finish_reason == "stop", f"{prompt!r} ran to max_tokens"
