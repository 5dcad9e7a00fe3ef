"""One bad request never hurts another (issue 13), offline.

* Every hostile value that used to pass `SamplingParams` and then crash inside a step is
  refused at `add_request` with a ValueError naming the field; nothing is queued.
* A request that fails inside a step anyway (injected faults: in the model, in its own output
  processing) finishes alone with finish_reason "abort" and a message; the others in its
  batch finish with exactly the tokens they get when run without it; every block comes back.
* A hypothesis property over every `SamplingParams` field and every prompt form: no error but
  a ValueError, no leaked block, and the engine still answers a reference request unchanged.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import engine_test_checkpoints as checkpoints  # registered by tests/conftest.py
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams

VOCAB = checkpoints.VOCAB_SIZE
MAX_MODEL_LEN = 64
ENGINE_KWARGS = dict(device="cpu", block_size=8, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                     num_gpu_blocks_override=24, swap_space=0.001, seed=0)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("robustness") / "llama"
    checkpoints.save_checkpoint("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def engine(llama_path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=llama_path, **ENGINE_KWARGS))


def run(engine: LLMEngine, max_steps: int = 2_000) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"the engine did not drain in {max_steps} steps")


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    block_manager = engine.scheduler.block_manager
    assert block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    assert block_manager.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks


def prompt(seed: int, length: int = 6) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(length)]}


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def reference(engine: LLMEngine, seeds=(1, 2, 3)) -> dict[str, list[int]]:
    """Each good request's tokens when it runs alone."""
    tokens = {}
    for seed in seeds:
        engine.add_request(f"ref-{seed}", prompt(seed), GREEDY)
        tokens[f"good-{seed}"] = run(engine)[f"ref-{seed}"].outputs[0].token_ids
    return tokens


# ---------------------------------------------------------- refused at the boundary
# The values of the issue that passed SamplingParams and crashed a step (the vocabulary has
# 128 tokens, max_model_len is 64), and their field.
HOSTILE = [
    (dict(logprobs=VOCAB + 1), "logprobs"),
    (dict(prompt_logprobs=VOCAB + 1), "prompt_logprobs"),
    (dict(stop_token_ids=[VOCAB], min_tokens=1), "stop_token_ids"),
    (dict(seed=2**64), "seed"),
    (dict(seed=True), "seed"),
    (dict(top_k=2**63), "top_k"),
    (dict(n=2, best_of=2, use_beam_search=True, temperature=0.0, length_penalty=400.0), "length_penalty"),
    (dict(n=2, best_of=2, use_beam_search=True, temperature=0.0, length_penalty=1e300), "length_penalty"),
    (dict(n=2, best_of=2, use_beam_search=True, temperature=0.0, length_penalty=-1e300), "length_penalty"),
    (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(min_tokens=MAX_MODEL_LEN, max_tokens=None), "min_tokens"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=math.inf), "top_p"),
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(stop=5), "stop"),
]


@pytest.mark.parametrize("kwargs, field", HOSTILE, ids=[f"{f}={list(k.values())[-1]!r}"[:40] for k, f in HOSTILE])
def test_hostile_values_are_refused_naming_the_field_and_nothing_is_queued(engine, kwargs, field):
    with pytest.raises(ValueError, match=field) as refused:
        engine.add_request("hostile", prompt(0), SamplingParams(**kwargs))
    assert getattr(refused.value, "param", field) == field
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_a_batch_enters_whole_or_not_at_all(llama_path):
    llm = LLM(llama_path, **ENGINE_KWARGS)
    good = [prompt(1), prompt(2)]
    for bad in ({"prompt_token_ids": [1, "x"]}, 42, {"prompt_token_ids": [VOCAB]}):
        with pytest.raises((ValueError, TypeError)):
            llm.generate([*good, bad], GREEDY, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()  # the first two were taken back
    outputs = llm.generate(good, GREEDY, use_tqdm=False)  # and do not run inside this call
    assert [o.request_id for o in outputs] == [outputs[0].request_id, outputs[1].request_id]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert_all_blocks_free(llm.llm_engine)


def test_an_early_ending_carries_its_own_reason(engine):
    engine.add_request("too-many", prompt(0), SamplingParams(n=9, temperature=1.0, max_tokens=4))
    engine.add_request("too-long", prompt(0, length=MAX_MODEL_LEN + 1), GREEDY)
    outputs = run(engine)
    for request_id, words in (("too-many", "max_num_seqs"), ("too-long", "max_model_len")):
        completion = outputs[request_id].outputs[0]
        assert completion.finish_reason == "abort" and words in completion.finish_message
    assert_all_blocks_free(engine)


# ------------------------------------------------------------ failures inside a step
def poison_the_model(monkeypatch, engine: LLMEngine, poisoned: str) -> list[int]:
    """The model raises whenever request `poisoned` is in the batch; returns the batch sizes seen."""
    real = engine.model_executor.execute_model
    batch_sizes = []

    def execute_model(request):
        batch_sizes.append(len(request.seq_group_metadata_list))
        if any(m.request_id == poisoned for m in request.seq_group_metadata_list):
            raise IndexError("injected: index out of range")
        return real(request)

    monkeypatch.setattr(engine.model_executor, "execute_model", execute_model)
    return batch_sizes


def poison_the_output_processing(monkeypatch, engine: LLMEngine, poisoned: str) -> None:
    real = engine.output_processor.process_outputs

    def process_outputs(seq_group, samples, *args, **kwargs):
        if seq_group.request_id == poisoned:
            raise RuntimeError("injected: detokenizer failure")
        return real(seq_group, samples, *args, **kwargs)

    monkeypatch.setattr(engine.output_processor, "process_outputs", process_outputs)


@pytest.fixture(scope="module")
def multi_step_engine(llama_path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=llama_path, num_scheduler_steps=4, **ENGINE_KWARGS))


@pytest.mark.parametrize("where", ["model", "output processing"])
@pytest.mark.parametrize("engine_fixture", ["engine", "multi_step_engine"])
def test_a_request_failing_inside_a_step_ends_alone(request, engine_fixture, monkeypatch, where, caplog):
    engine = request.getfixturevalue(engine_fixture)
    expected = reference(engine)
    if where == "model":
        batch_sizes = poison_the_model(monkeypatch, engine, "poison")
    else:
        poison_the_output_processing(monkeypatch, engine, "poison")
    engine.add_request("good-1", prompt(1), GREEDY)
    engine.add_request("poison", prompt(9), GREEDY)
    engine.add_request("good-2", prompt(2), GREEDY)
    outputs = run(engine)
    engine.add_request("good-3", prompt(3), GREEDY)  # the engine goes on after the failure
    outputs |= run(engine)

    poisoned = outputs["poison"].outputs[0]
    assert poisoned.finish_reason == "abort" and "engine step" in poisoned.finish_message
    assert "poison" in caplog.text  # the traceback is in the log, under the request id
    for request_id, tokens in expected.items():
        assert outputs[request_id].outputs[0].token_ids == tokens
        assert outputs[request_id].outputs[0].finish_reason == "length"
    if where == "model":
        assert batch_sizes[0] == 3 and batch_sizes[1:4] == [1, 1, 1]  # the batch, then each alone
    assert_all_blocks_free(engine)


def test_llm_generate_reports_the_failed_request_and_stays_usable(llama_path, monkeypatch):
    llm = LLM(llama_path, **ENGINE_KWARGS)
    expected = llm.generate([prompt(1)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    real = llm.llm_engine.model_executor.execute_model
    poison_ids = prompt(9)["prompt_token_ids"]

    def execute_model(request):
        if any(list(m.seq_data.values())[0].prompt_token_ids == poison_ids for m in request.seq_group_metadata_list):
            raise IndexError("injected")
        return real(request)

    monkeypatch.setattr(llm.llm_engine.model_executor, "execute_model", execute_model)
    good, bad = llm.generate([prompt(1), prompt(9)], GREEDY, use_tqdm=False)
    assert good.outputs[0].token_ids == expected and bad.outputs[0].finish_reason == "abort"
    monkeypatch.undo()
    assert llm.generate([prompt(1)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert_all_blocks_free(llm.llm_engine)


# ---------------------------------------------------------------- the property
# Each field: values SamplingParams must take (VALID), and values of any type or size (ODD:
# any field gets the generic ones, some also the ones that used to crash a step). An example
# draws valid values for some fields and, usually, one odd value for one field, so that both
# the refusals and the runs that follow them get explored.
GENERIC_ODD = [math.nan, math.inf, -math.inf, 1e300, -1e300, 2**64, -(2**63) - 1, True, "1", None, -1, 0.5, [1]]
FIELD_ODD = {
    "stop_token_ids": [[VOCAB], [-1], [2**63], [VOCAB - 1]],
    "logprobs": [VOCAB, VOCAB + 1], "prompt_logprobs": [VOCAB, VOCAB + 1],
    "min_tokens": [MAX_MODEL_LEN, MAX_MODEL_LEN - 1],
    "seed": [2**64 - 1, 2**64, True], "top_k": [2**63 - 1, 2**63],
    "length_penalty": [400.0, 1e300, -1e300, 10.0, -10.0],
    "skip_special_tokens": [1, "no"], "early_stopping": ["sometimes", 1],
}


def odd_value(name: str):
    if name not in FIELD_ODD:
        return st.sampled_from(GENERIC_ODD)
    return st.one_of(st.sampled_from(FIELD_ODD[name]), st.sampled_from(GENERIC_ODD))


VALID = {
    "n": st.sampled_from([1, 1, 1, 2, 3]),
    "best_of": st.sampled_from([None, None, None, 2, 4]),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.1, 1),
    "top_k": st.integers(-1, VOCAB + 5),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "use_beam_search": st.sampled_from([False, False, False, True]),
    "length_penalty": st.floats(-10, 10),
    "early_stopping": st.sampled_from([True, False, "never"]),
    "stop": st.one_of(st.none(), st.text("ab\n", min_size=1, max_size=2),
                      st.lists(st.text("ab ", min_size=1, max_size=2), max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "max_tokens": st.sampled_from([None, 4, 6, 8, 12]),
    "min_tokens": st.sampled_from([0, 1, 4]),
    "logprobs": st.one_of(st.none(), st.integers(0, 3), st.just(VOCAB)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3), st.just(VOCAB)),
    "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
}
ODD_FIELD_NAME = st.one_of(st.sampled_from(sorted(FIELD_ODD)), st.sampled_from(sorted(VALID)))
ONE_ODD_FIELD = st.one_of(st.just({}), ODD_FIELD_NAME.flatmap(lambda name: odd_value(name).map(lambda v: {name: v})))
# min_tokens always drawn: several of the old crashes needed it together with another field.
SAMPLING_KWARGS = st.builds(lambda always, valid, odd: always | valid | odd,
                            st.fixed_dictionaries({"min_tokens": VALID["min_tokens"]}),
                            st.fixed_dictionaries({}, optional=VALID), ONE_ODD_FIELD)
TOKEN_IDS = st.lists(st.one_of(st.integers(-2, VOCAB + 2), st.sampled_from([2**64, True, "7", 1.0])), max_size=4)
VALID_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=70)
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=12),
    st.builds(lambda ids: {"prompt_token_ids": ids}, VALID_IDS),
    st.builds(lambda ids: {"prompt_token_ids": ids}, VALID_IDS),
    st.text(max_size=3),
    st.builds(lambda ids: {"prompt_token_ids": ids}, TOKEN_IDS),
    st.builds(lambda text, ids: {"prompt": text, "prompt_token_ids": ids}, st.one_of(st.text(max_size=3), st.just(5)),
              st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)),
    st.sampled_from([None, 5, b"bytes", {"text": "x"}, {"prompt_token_ids": "abc"}, ["a", "b"]]),
)


@pytest.fixture(scope="module")
def check_tokens(engine) -> list[int]:
    """A plain greedy request's tokens, to check the engine against after each example."""
    engine.add_request("first-check", prompt(1), GREEDY)
    return run(engine)["first-check"].outputs[0].token_ids


def with_the_issues_crashes(test):
    """Run every value that once crashed a step as an explicit example, whatever is drawn."""
    for kwargs, _ in HOSTILE:
        test = example(kwargs=kwargs, prompt_input=prompt(0))(test)
    return test


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@with_the_issues_crashes
@given(kwargs=SAMPLING_KWARGS, prompt_input=PROMPTS)
def test_any_sampling_params_and_prompt_is_refused_or_served_without_harm(engine, check_tokens, kwargs, prompt_input):
    try:
        params = SamplingParams(**kwargs)
        engine.add_request("fuzz", prompt_input, params)
    except ValueError:
        event("refused")
        assert not engine.has_unfinished_requests()  # refused: nothing queued
    else:
        output = run(engine)["fuzz"]
        event(f"served: {output.outputs[0].finish_reason}")
        assert all(c.finish_reason in ("stop", "length", "abort") for c in output.outputs)
        # No internal error either: what the boundary accepted ran without the step's safety net.
        assert not any("engine step" in (c.finish_message or "") for c in output.outputs), output
    assert_all_blocks_free(engine)
    # The engine is as good as new: a plain greedy request gets the same tokens as ever.
    engine.add_request("check", prompt(1), GREEDY)
    assert run(engine)["check"].outputs[0].token_ids == check_tokens


def test_a_failed_prefill_leaves_nothing_uncomputed_in_the_prefix_cache(llama_path, monkeypatch):
    """The scheduler registers a prefill's full blocks in the prefix cache when it schedules
    them (the step is meant to compute them before anyone reads them). If the model fails
    instead, those blocks hold no K/V: a later request with the same prompt must not reuse them."""
    long_prompt = prompt(11, length=20)
    fresh = LLMEngine.from_engine_args(EngineArgs(model=llama_path, **ENGINE_KWARGS))
    fresh.add_request("ref", long_prompt, GREEDY)
    expected = run(fresh)["ref"].outputs[0].token_ids
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_path, enable_prefix_caching=True, **ENGINE_KWARGS))
    poison_the_model(monkeypatch, engine, "poison")
    engine.add_request("poison", long_prompt, GREEDY)
    assert run(engine)["poison"].outputs[0].finish_reason == "abort"
    engine.add_request("again", long_prompt, GREEDY)
    assert run(engine)["again"].outputs[0].token_ids == expected
    assert_all_blocks_free(engine)
