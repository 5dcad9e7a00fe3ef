"""`LLM.generate`: vLLM's offline API over the engine."""

import pytest

import engine_test_checkpoints as checkpoints  # registered by conftest.py
import minivllm
from minivllm import LLM, SamplingParams
from minivllm.bundled_models import resolve_model


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama[0], device="cpu", block_size=8)


def test_outputs_come_back_in_input_order_and_match_transformers(llm, tiny_llama):
    _, hf_model = tiny_llama
    tokenizer = llm.get_tokenizer()
    prompts = ["To be", "or not to be, that is", "Q"]
    # The first prompt runs longest, so requests finish in a different order than given.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 3, 6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for prompt, param, output in zip(prompts, params, outputs):
        prompt_ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == prompt_ids
        assert output.finished
        assert output.outputs[0].token_ids == checkpoints.hf_greedy(hf_model, prompt_ids, param.max_tokens)
    engine = llm.llm_engine
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_prompt_forms_single_string_and_token_ids(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [from_text] = llm.generate("abc", params, use_tqdm=False)
    [from_ids] = llm.generate({"prompt_token_ids": from_text.prompt_token_ids}, params, use_tqdm=False)
    assert from_ids.prompt is None
    assert from_ids.outputs[0].token_ids == from_text.outputs[0].token_ids


def test_default_params_and_param_count_mismatch(llm):
    [output] = llm.generate(["x"], use_tqdm=False)
    assert 1 <= len(output.outputs[0].token_ids) <= SamplingParams().max_tokens
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_a_bad_prompt_rejects_the_call_and_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [output] = llm.generate(["fine"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.finished


def test_progress_bar_reports_throughput(llm, capsys):
    pytest.importorskip("tqdm")  # a declared dependency; some bare GPU images lack it
    llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "toks/s" in err


def test_default_model_is_the_bundled_one():
    llm = LLM(device="cpu", num_gpu_blocks_override=64)
    assert llm.llm_engine.model_config.model == resolve_model(None)
    [output] = llm.generate("ROMEO:", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert output.outputs[0].text


def test_top_level_exports_are_lazy():
    import subprocess
    import sys

    code = "import sys, minivllm; assert 'torch' not in sys.modules; minivllm.LLM; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert set(minivllm.__all__) >= {"LLM", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput", "SamplingParams"}


# ----------------------------------------------------------------------------- vLLM's keyword forms

def test_generate_takes_prompt_token_ids_and_text_prompt_dicts(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [from_text] = llm.generate("abc", params, use_tqdm=False)
    ids = from_text.prompt_token_ids
    [one] = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    two = llm.generate(sampling_params=params, prompt_token_ids=[ids, ids[:2]], use_tqdm=False)
    [as_dict] = llm.generate({"prompt": "abc"}, params, use_tqdm=False)
    assert one.outputs[0].token_ids == two[0].outputs[0].token_ids == from_text.outputs[0].token_ids
    assert two[1].prompt_token_ids == ids[:2]
    assert as_dict.prompt == "abc" and as_dict.outputs[0].token_ids == from_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="one of the two"):
        llm.generate("abc", params, prompt_token_ids=ids, use_tqdm=False)
    with pytest.raises(ValueError, match="one of the two"):
        llm.generate(sampling_params=params, use_tqdm=False)


def test_generate_takes_one_priority_per_prompt(tiny_llama):
    llm = LLM(tiny_llama[0], device="cpu", scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outputs = llm.generate(["a", "b"], params, priority=[1, 0], use_tqdm=False)
    assert [o.prompt for o in outputs] == ["a", "b"] and all(o.finished for o in outputs)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], params, priority=[0], use_tqdm=False)


# ----------------------------------------------------------------------------- chat

MESSAGES = [{"role": "system", "content": "Speak as a king."}, {"role": "user", "content": "Who goes there?"}]


@pytest.fixture(scope="module")
def bundled_llm():
    return LLM(device="cpu", num_gpu_blocks_override=64)


def test_chat_renders_the_tokenizers_chat_template_like_transformers(bundled_llm):
    tokenizer = bundled_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    [reply] = bundled_llm.chat(MESSAGES, params, use_tqdm=False)
    # transformers' own rendering and tokenization of the conversation (the template writes BOS).
    expected_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply.prompt_token_ids == list(expected_ids)
    assert reply.prompt == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    [same] = bundled_llm.generate(prompt_token_ids=list(expected_ids), sampling_params=params, use_tqdm=False)
    assert reply.outputs[0].token_ids == same.outputs[0].token_ids


def test_chat_takes_a_batch_a_template_and_no_generation_prompt(bundled_llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    other = [{"role": "user", "content": "Good morrow."}]
    replies = bundled_llm.chat([MESSAGES, other], params, use_tqdm=False)
    [alone] = bundled_llm.chat(other, params, use_tqdm=False)
    assert len(replies) == 2 and replies[1].outputs[0].token_ids == alone.outputs[0].token_ids
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    [custom] = bundled_llm.chat(other, params, chat_template=template, use_tqdm=False)
    assert custom.prompt == "Good morrow.\n"
    [open_prompt] = bundled_llm.chat(other, params, add_generation_prompt=False, use_tqdm=False)
    assert not open_prompt.prompt.endswith("ASSISTANT:")
    with pytest.raises(ValueError, match="empty"):
        bundled_llm.chat([], params, use_tqdm=False)
