"""LLMEngine's API: stop conditions, bad input, aborts in every state, metrics, snapshots."""

import logging
import random

import pytest

import engine_test_checkpoints as checkpoints  # registered by conftest.py
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import LoggingStatLogger, Stats
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceStatus
from minivllm.viz.snapshot import SnapshotRecorder

BLOCK_SIZE = 8


@pytest.fixture
def engine(checkpoint_dirs) -> LLMEngine:
    path, _ = checkpoint_dirs["llama"]
    return LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=BLOCK_SIZE, max_model_len=64))


def run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def random_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, checkpoints.VOCAB_SIZE) for _ in range(length)]


def greedy(max_tokens=16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    block_manager = engine.scheduler.block_manager
    assert block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    assert block_manager.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks


# ------------------------------------------------------------------ text prompts and stops
def test_text_prompt_is_tokenized_and_detokenized(engine):
    engine.add_request("t", "To be, or not", greedy(ignore_eos=True))
    output = run(engine)["t"]
    tokenizer = engine.get_tokenizer()
    assert output.prompt == "To be, or not"
    assert output.prompt_token_ids == tokenizer.encode("To be, or not")
    completion = output.outputs[0]
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.finish_reason == "length" and completion.stop_reason is None


def test_streaming_text_grows_by_appending(engine):
    engine.add_request("s", {"prompt_token_ids": random_prompt(5)}, greedy(max_tokens=10, ignore_eos=True))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert len(texts) == 10


def reference_tokens(engine, prompt, n=16):
    engine.add_request("ref", {"prompt_token_ids": prompt}, greedy(max_tokens=n, ignore_eos=True))
    return run(engine)["ref"].outputs[0].token_ids


def test_stop_token_ids_stop_with_the_token_as_stop_reason(engine):
    prompt = random_prompt(6, seed=1)
    tokens = reference_tokens(engine, prompt)
    stop = tokens[3]
    first = tokens.index(stop)
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(stop_token_ids=[stop], ignore_eos=True))
    completion = run(engine)["r"].outputs[0]
    assert completion.token_ids == tokens[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_truncate_the_text(engine, include):
    prompt = random_prompt(6, seed=2)
    tokens = reference_tokens(engine, prompt)
    full_text = engine.get_tokenizer().decode(tokens)
    stop = full_text[4:6]
    assert stop
    engine.add_request("r", {"prompt_token_ids": prompt},
                       greedy(stop=[stop], include_stop_str_in_output=include, ignore_eos=True))
    completion = run(engine)["r"].outputs[0]
    cut = full_text.index(stop)
    assert completion.text == full_text[: cut + len(stop)] if include else full_text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(checkpoint_dirs, tmp_path):
    """A checkpoint whose tokenizer calls a token the greedy output emits "EOS"; the reference
    is transformers' generate with that eos_token_id."""
    path, hf_model = checkpoint_dirs["llama"]
    prompt = random_prompt(6, seed=3)
    tokens = checkpoints.hf_greedy(hf_model, prompt, 16)
    eos = tokens[2]
    eos_dir = tmp_path / "eos"
    hf_model.save_pretrained(eos_dir, safe_serialization=True)
    vocab = checkpoints.build_tokenizer()
    eos_text = vocab.convert_ids_to_tokens(eos)
    tokenizer = checkpoints.build_tokenizer()
    tokenizer.eos_token = eos_text
    tokenizer.save_pretrained(eos_dir)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(eos_dir), device="cpu", block_size=BLOCK_SIZE))
    assert engine.eos_token_id == eos
    engine.add_request("eos", {"prompt_token_ids": prompt}, greedy())
    engine.add_request("ignore", {"prompt_token_ids": prompt}, greedy(ignore_eos=True))
    engine.add_request("min", {"prompt_token_ids": prompt}, greedy(min_tokens=tokens.index(eos) + 2))
    outputs = run(engine)
    import torch

    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                     eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    assert outputs["eos"].outputs[0].token_ids == expected
    assert outputs["eos"].outputs[0].finish_reason == "stop"
    assert outputs["eos"].outputs[0].stop_reason is None
    assert outputs["ignore"].outputs[0].token_ids == tokens
    min_tokens = outputs["min"].outputs[0].token_ids
    assert len(min_tokens) >= tokens.index(eos) + 2 and eos not in min_tokens[: tokens.index(eos) + 2]


def test_max_model_len_caps_prompt_plus_output(engine):
    engine.add_request("long", {"prompt_token_ids": random_prompt(60)}, greedy(max_tokens=50, ignore_eos=True))
    completion = run(engine)["long"].outputs[0]
    assert len(completion.token_ids) == 64 - 60
    assert completion.finish_reason == "length"


# ------------------------------------------------------------------ bad input
def test_bad_input_is_rejected_clearly_and_the_engine_keeps_serving(engine, caplog):
    engine.add_request("good", {"prompt_token_ids": random_prompt(5)}, greedy(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", greedy())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty-ids", {"prompt_token_ids": []}, greedy())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad-ids", {"prompt_token_ids": [1, 10**9]}, greedy())
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("good", "again", greedy())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("bad-params", "x", SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("prio", "x", greedy(), priority=3)
    # Too long for max_model_len=64: accepted, then finished with a reason at the next step.
    engine.add_request("too-long", {"prompt_token_ids": random_prompt(65)}, greedy())
    with caplog.at_level(logging.WARNING):
        engine.abort_request("no-such-request")
    assert "no-such-request" in caplog.text
    outputs = run(engine)
    assert outputs["too-long"].finished and outputs["too-long"].outputs[0].finish_reason == "abort"
    assert "max_model_len" in outputs["too-long"].outputs[0].finish_message
    assert outputs["too-long"].outputs[0].token_ids == []
    assert len(outputs["good"].outputs[0].token_ids) == 4
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_abort_in_every_state_frees_every_block(checkpoint_dirs, preemption_mode):
    path, _ = checkpoint_dirs["llama"]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=path, device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks_override=12, preemption_mode=preemption_mode,
        max_num_seqs=4, max_model_len=128))
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60, ignore_eos=True, n=2)
    for i in range(6):
        engine.add_request(str(i), {"prompt_token_ids": random_prompt(20, seed=i)}, params)
    seen = set()
    for _ in range(200):
        engine.step()
        scheduler = engine.scheduler
        seen |= {name for name, queue in (("waiting", scheduler.waiting), ("running", scheduler.running),
                                           ("swapped", scheduler.swapped)) if queue}
        if {"waiting", "running"} <= seen and (preemption_mode == "recompute" or "swapped" in seen) \
                and scheduler.waiting and scheduler.running:
            break
    states = {g.request_id: g.get_seqs()[0].status for q in (scheduler.waiting, scheduler.running, scheduler.swapped) for g in q}
    assert SequenceStatus.WAITING in states.values() and SequenceStatus.RUNNING in states.values()
    if preemption_mode == "swap":
        assert SequenceStatus.SWAPPED in states.values()
    engine.abort_request(list(states))
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_all_blocks_free(engine)


def test_abort_running_request_leaves_others_untouched(engine):
    engine.add_request("a", {"prompt_token_ids": random_prompt(5, 1)}, greedy(max_tokens=8, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": random_prompt(5, 2)}, greedy(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    outputs = run(engine)
    assert set(outputs) == {"b"} and len(outputs["b"].outputs[0].token_ids) == 8
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------ metrics and snapshots
def test_stats_reach_every_logger_after_every_step(engine):
    collected: list[Stats] = []
    lines: list[str] = []

    class Collector:
        def log(self, stats):
            collected.append(stats)

    engine.add_logger("collect", Collector())
    engine.add_logger("print", LoggingStatLogger(local_interval=0.0, log_fn=lines.append))
    with pytest.raises(KeyError):
        engine.add_logger("collect", Collector())
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": random_prompt(9, i)}, greedy(max_tokens=5, ignore_eos=True))
    run(engine)
    assert sum(s.num_prompt_tokens_iter for s in collected) == 27
    assert sum(s.num_generation_tokens_iter for s in collected) == 15
    assert len([t for s in collected for t in s.time_to_first_tokens_iter]) == 3
    assert len([t for s in collected for t in s.time_per_output_tokens_iter]) == 12
    assert len([t for s in collected for t in s.time_e2e_requests]) == 3
    assert max(s.gpu_cache_usage_sys for s in collected) > 0 and collected[-1].gpu_cache_usage_sys == 0
    assert len(lines) == len(collected)
    assert "GPU KV cache usage" in lines[0] and "Prefix cache hit rate" in lines[0] and "TTFT" in lines[0]


def test_snapshots_record_every_step_with_block_tables(engine):
    recorder = SnapshotRecorder(engine)
    for i in range(2):
        engine.add_request(str(i), {"prompt_token_ids": random_prompt(12, i)}, greedy(max_tokens=3, ignore_eos=True))
    run(engine)
    snapshots = recorder.snapshots
    assert [s.step for s in snapshots] == list(range(len(snapshots)))
    assert snapshots[0].batch[0].is_prefill and snapshots[0].num_batched_tokens == 24
    assert snapshots[0].block_tables["0"] and len(next(iter(snapshots[0].block_tables["0"].values()))) == 2
    assert sorted(r for s in snapshots for r in s.finished) == ["0", "1"]


def test_final_only_requests_report_nothing_until_they_finish(tiny_llama):
    """RequestOutputKind.FINAL_ONLY (what LLM.generate asks for): no per-step outputs."""
    from minivllm.sampling_params import RequestOutputKind

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama[0], device="cpu"))
    final = SamplingParams(temperature=0.0, max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final", {"prompt_token_ids": [3, 4, 5]}, final)
    engine.add_request("streamed", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0.0, max_tokens=5))
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append({o.request_id: o for o in engine.step()})
    assert all("streamed" in step for step in per_step)
    assert [("final" in step) for step in per_step] == [False] * (len(per_step) - 1) + [True]
    last = per_step[-1]
    assert last["final"].finished and last["final"].outputs[0].token_ids == last["streamed"].outputs[0].token_ids


# ------------------------------------------------------------------ skip_tokenizer_init
def test_skip_tokenizer_init_takes_and_gives_token_ids_only(checkpoint_dirs, engine):
    """vLLM's `skip_tokenizer_init`: no tokenizer is loaded; a text prompt or a stop string is a
    ValueError; outputs carry the same token ids as with a tokenizer, and empty text."""
    path, _ = checkpoint_dirs["llama"]
    bare = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", block_size=BLOCK_SIZE, max_model_len=64,
                                                 skip_tokenizer_init=True))
    assert bare.get_tokenizer() is None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        bare.add_request("text", "ROMEO:", greedy())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.add_request("stop", {"prompt_token_ids": random_prompt(5)}, greedy(stop=["x"]))
    for e in (bare, engine):
        e.add_request("ids", {"prompt_token_ids": random_prompt(10)}, greedy(max_tokens=6, ignore_eos=True))
    without, with_tokenizer = run(bare)["ids"], run(engine)["ids"]
    assert without.outputs[0].token_ids == with_tokenizer.outputs[0].token_ids and len(without.outputs[0].token_ids) == 6
    assert without.outputs[0].text == "" and with_tokenizer.outputs[0].text != ""
    assert_all_blocks_free(bare)
