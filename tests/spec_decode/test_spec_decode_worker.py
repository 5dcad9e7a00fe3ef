"""Speculative decoding in the engine: the output is the target's, whatever the proposer.

Greedy output must be token-identical to the target decoding alone with a draft that is an
exact copy of the target (everything accepted), an unrelated draft (almost everything
rejected) and n-gram lookup, also while the scheduler preempts (recompute and swap). Each
run also checks that speculation really happened (the acceptance counts) and that every
block came back.
"""

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import StatLoggerBase
from minivllm.sampling_params import InvalidParameterError, SamplingParams

from engine_test_checkpoints import assert_all_blocks_free, mixed_prompts

K = 3
# 9 blocks of 8 tokens for 6 requests of up to 40 + 24 tokens: the scheduler must preempt.
SMALL_POOL = dict(block_size=8, num_gpu_blocks_override=9)


class StatsRecorder(StatLoggerBase):
    def __init__(self):
        self.stats = []

    def log(self, stats):
        self.stats.append(stats)

    @property
    def preemptions(self) -> int:
        return sum(s.num_preemption_iter for s in self.stats)

    @property
    def spec(self):
        """The last cumulative acceptance counts."""
        return [s.spec_decode_metrics for s in self.stats if s.spec_decode_metrics is not None][-1]


def make_engine(model, **kwargs) -> tuple[LLMEngine, StatsRecorder]:
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, device="cpu", **({"block_size": 8} | kwargs)))
    recorder = StatsRecorder()
    engine.add_logger("recorder", recorder)
    return engine, recorder


def run(engine, prompts, params, abort_after: dict[str, int] | None = None) -> dict:
    """request id -> CompletionOutput; `abort_after`: request id -> the step to abort it at."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    results, step = {}, 0
    while engine.has_unfinished_requests():
        for request_id, at in (abort_after or {}).items():
            if step == at:
                engine.abort_request(request_id)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0]
        step += 1
    assert_all_blocks_free(engine)
    return results


def tokens(results) -> dict:
    return {rid: (out.token_ids, out.finish_reason) for rid, out in results.items()}


PROMPTS = mixed_prompts(6, seed=11)
GREEDY = [SamplingParams(temperature=0.0, max_tokens=12 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def reference(spec_checkpoints):
    """The target alone, with room for everything, and with the small pool."""
    roomy = tokens(run(make_engine(spec_checkpoints["target"])[0], PROMPTS, GREEDY))
    engine, recorder = make_engine(spec_checkpoints["target"], **SMALL_POOL)
    assert tokens(run(engine, PROMPTS, GREEDY)) == roomy
    return roomy


@pytest.mark.parametrize("preemption_mode", [None, "swap"])
@pytest.mark.parametrize("proposer", ["copy", "unrelated", "ngram"])
def test_greedy_output_is_the_targets_under_preemption(spec_checkpoints, reference, proposer, preemption_mode):
    spec = {"copy": dict(speculative_model=spec_checkpoints["target"]),
            "unrelated": dict(speculative_model=spec_checkpoints["unrelated"]),
            "ngram": dict(speculative_model="[ngram]", ngram_prompt_lookup_max=3)}[proposer]
    engine, recorder = make_engine(spec_checkpoints["target"], num_speculative_tokens=K,
                                   preemption_mode=preemption_mode, **SMALL_POOL, **spec)
    assert tokens(run(engine, PROMPTS, GREEDY)) == reference
    assert recorder.preemptions > 0
    metrics = recorder.spec
    assert metrics.draft_tokens > 0 and metrics.num_spec_tokens == K
    assert metrics.accepted_tokens < metrics.emitted_tokens <= metrics.accepted_tokens + metrics.draft_tokens
    if proposer == "copy":  # the draft is the target: its cache kept up through every preemption
        assert metrics.draft_acceptance_rate == 1.0 and metrics.system_efficiency == 1.0
    if proposer == "unrelated":
        assert metrics.draft_acceptance_rate < 0.2
    if proposer == "ngram":  # random tiny models repeat themselves: lookup finds matches
        assert metrics.draft_acceptance_rate > 0.3


ROUNDS = 3


@pytest.mark.parametrize("preemption_mode", [None, "swap"])
@pytest.mark.parametrize("proposer", ["copy", "ngram"])
def test_several_rounds_per_schedule_keep_the_targets_output(spec_checkpoints, reference, proposer, preemption_mode):
    """num_scheduler_steps > 1: each schedule runs up to ROUNDS propose-score-accept rounds
    (multi-step composed with speculation) in the slots the scheduler reserved for all of them."""
    spec = {"copy": dict(speculative_model=spec_checkpoints["target"]),
            "ngram": dict(speculative_model="[ngram]", ngram_prompt_lookup_max=3)}[proposer]
    engine, recorder = make_engine(spec_checkpoints["target"], num_speculative_tokens=K, num_scheduler_steps=ROUNDS,
                                   preemption_mode=preemption_mode, **SMALL_POOL, **spec)
    assert tokens(run(engine, PROMPTS, GREEDY)) == reference
    assert recorder.preemptions > 0 and recorder.spec.draft_tokens > 0
    if proposer == "copy":
        assert recorder.spec.draft_acceptance_rate == 1.0


def test_rounds_emit_up_to_rounds_times_k_plus_1_tokens_per_schedule(spec_checkpoints):
    prompt, params = PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine, _ = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["target"],
                            num_speculative_tokens=K, num_scheduler_steps=ROUNDS)
    run(engine, prompt, params)
    # 1 prefill step (1 token), then up to ROUNDS * (K + 1) = 12 tokens per schedule: 23 = 12 + 11.
    assert engine.step_counter == 1 + 2


def test_fewer_steps_than_tokens_when_drafts_are_accepted(spec_checkpoints):
    prompt, params = PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine, _ = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["target"],
                            num_speculative_tokens=K)
    run(engine, prompt, params)
    # 1 prefill step (1 token), then K + 1 tokens per step: ceil(23 / 4) = 6 decode steps.
    assert engine.step_counter == 1 + 6


@pytest.mark.parametrize("rounds", [1, ROUNDS])
def test_stop_conditions_inside_the_accepted_tokens(spec_checkpoints, reference, rounds):
    """A stop token, max_tokens or max_model_len reached in the middle of the accepted tokens
    (or of a later round's): the output stops there, as without speculation."""
    stop_at = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                              stop_token_ids=[reference[str(i)][0][4 + i % 3]]) for i in range(len(PROMPTS))]
    lengths = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 6, 7)]
    params = stop_at + lengths
    expected = tokens(run(make_engine(spec_checkpoints["target"], max_model_len=50)[0], PROMPTS * 2, params))
    engine, recorder = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["target"],
                                   num_speculative_tokens=K, max_model_len=50, num_scheduler_steps=rounds)
    assert tokens(run(engine, PROMPTS * 2, params)) == expected
    assert {reason for _, reason in expected.values()} == {"stop", "length"}
    assert recorder.spec.draft_tokens > 0


@pytest.mark.parametrize("rounds", [1, ROUNDS])
def test_requests_that_cannot_speculate_decode_plainly_beside_those_that_do(spec_checkpoints, rounds):
    """n > 1, a seed, logprobs or penalties: no lookahead or no proposals for that request; it
    rides along in the scoring pass with one token and the plain sampler, and its output is
    what it is without speculation."""
    prompts = PROMPTS[:5]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)]

    def all_outputs(engine):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
        results = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = [(o.token_ids, o.finish_reason) for o in output.outputs]
        assert_all_blocks_free(engine)
        return results

    expected = all_outputs(make_engine(spec_checkpoints["target"])[0])
    engine, recorder = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["target"],
                                   num_speculative_tokens=K, num_scheduler_steps=rounds)
    assert all_outputs(engine) == expected
    assert recorder.spec.draft_tokens > 0


def test_random_sampling_speculates_and_returns_every_block(spec_checkpoints):
    """Unseeded random requests speculate (the rejection sampler's distribution is checked in
    tests/model_executor/test_rejection_sampler.py); aborted ones return their blocks too."""
    engine, recorder = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["unrelated"],
                                   num_speculative_tokens=K, **SMALL_POOL)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True)
    results = run(engine, PROMPTS, params, abort_after={"1": 3, "4": 5})
    assert set(results) == {"0", "2", "3", "5"}  # (aborted requests are not reported)
    assert all(len(out.token_ids) == 20 for out in results.values())
    assert 0 < recorder.spec.accepted_tokens < recorder.spec.draft_tokens


def test_beam_search_is_refused_when_speculating(spec_checkpoints):
    engine, _ = make_engine(spec_checkpoints["target"], speculative_model="[ngram]", num_speculative_tokens=K,
                            ngram_prompt_lookup_max=2)
    with pytest.raises(InvalidParameterError, match="beam search"):
        engine.add_request("0", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, use_beam_search=True, temperature=0.0))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_model="{other_vocab}", num_speculative_tokens=K), "vocabulary"),
    (dict(speculative_model="{target}"), "needs num_speculative_tokens"),
    (dict(num_speculative_tokens=K), "need speculative_model"),
    (dict(ngram_prompt_lookup_max=3), "need speculative_model"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=K), "needs ngram_prompt_lookup_max"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=K, ngram_prompt_lookup_max=2,
          ngram_prompt_lookup_min=3), "ngram_prompt_lookup_min <= ngram_prompt_lookup_max"),
    (dict(speculative_model="{target}", num_speculative_tokens=K, ngram_prompt_lookup_max=2), "apply to"),
    (dict(speculative_model="{target}", num_speculative_tokens=0), "at least 1"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=K, ngram_prompt_lookup_max=2,
          enable_chunked_prefill=True), "chunked prefill"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=K, ngram_prompt_lookup_max=2,
          num_scheduler_steps=4, async_scheduling=True), "async_scheduling"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=K, ngram_prompt_lookup_max=2,
          tensor_parallel_size=2, distributed_executor_backend="mp"), "one worker"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=K, ngram_prompt_lookup_max=2,
          enable_lora=True), "enable_lora"),
])
def test_impossible_combinations_are_value_errors(spec_checkpoints, kwargs, message):
    kwargs = {k: v.format(**spec_checkpoints) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=spec_checkpoints["target"], device="cpu", **kwargs).create_engine_config()


def test_lookahead_slots_are_the_speculative_tokens(spec_checkpoints):
    config = EngineArgs(model=spec_checkpoints["target"], device="cpu", speculative_model="[ngram]",
                        num_speculative_tokens=5, ngram_prompt_lookup_max=2).create_engine_config()
    assert config.scheduler_config.num_lookahead_slots == 5
    assert config.speculative_config.method == "ngram" and config.speculative_config.ngram_prompt_lookup_min == 1
    rounds = EngineArgs(model=spec_checkpoints["target"], device="cpu", speculative_model="[ngram]",
                        num_speculative_tokens=5, ngram_prompt_lookup_max=2, num_scheduler_steps=3)
    config = rounds.create_engine_config()  # 3 rounds of up to 6 tokens: the next one and 17 more
    assert config.scheduler_config.num_lookahead_slots == 17 and not config.scheduler_config.async_scheduling


def test_acceptance_metrics_reach_the_log_line_and_prometheus_with_vllms_names(spec_checkpoints):
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.engine.metrics import LoggingStatLogger
    from minivllm.entrypoints.openai.metrics import PrometheusStatLogger

    engine, recorder = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["unrelated"],
                                   num_speculative_tokens=K)
    prometheus = PrometheusStatLogger(CollectorRegistry(), "tiny")
    lines = []
    engine.add_logger("prometheus", prometheus)
    engine.add_logger("log", LoggingStatLogger(local_interval=0.0, log_fn=lines.append))
    run(engine, PROMPTS[:3], GREEDY[:3])
    metrics = recorder.spec
    samples = {s.name: s.value for family in text_string_to_metric_families(prometheus.render().decode())
               for s in family.samples}
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == metrics.draft_tokens > 0
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == metrics.accepted_tokens
    assert samples["vllm:spec_decode_num_emitted_tokens_total"] == metrics.emitted_tokens
    assert samples["vllm:spec_decode_draft_acceptance_rate"] == metrics.accepted_tokens / metrics.draft_tokens
    assert 0 < samples["vllm:spec_decode_efficiency"] == metrics.system_efficiency <= 1
    assert f"Number of draft tokens: {metrics.draft_tokens}," in [line for line in lines if "Speculative" in line][-1]


def test_a_step_of_block_moves_only_runs_no_model(spec_checkpoints):
    """A step may only swap blocks out (no group scheduled): neither model runs."""
    from minivllm.sequence import ExecuteModelRequest

    engine, _ = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["target"],
                            num_speculative_tokens=K)
    outputs = engine.model_executor.execute_model(ExecuteModelRequest(seq_group_metadata_list=[]))
    assert [len(o) for o in outputs] == [0]


POISON = 100.0  # a key this large would dominate any softmax that read it


def poison_after_each_step(engine) -> None:
    """After every worker step, overwrite every cache slot the next steps must not read:
    in the target's cache, positions from the next input token on (rejected guesses' K/V and
    the unwritten rest of the table); in the draft's, from the second-to-last token on (the
    draft recomputes those two first). Finite values, so a masked-out slot stays harmless
    (0 x NaN would not)."""
    worker = engine.model_executor.driver_worker
    execute = worker.execute_model

    def poisoned(req):
        outputs = list(execute(req))
        for i, metadata in enumerate(req.seq_group_metadata_list):
            emitted = sum(1 for out in outputs if out[i].samples)
            for seq_id, data in metadata.seq_data.items():
                new_len = data.get_len() + emitted  # (the engine appends the tokens after this)
                table = metadata.block_tables[seq_id]
                _poison(worker.kv_caches, table, new_len - 1, worker.cache_config.block_size)
                if hasattr(worker.proposer, "kv_caches"):
                    _poison(worker.proposer.kv_caches, table, new_len - 2, worker.cache_config.block_size)
        return outputs

    worker.execute_model = poisoned


def _poison(caches, table, first_position: int, block_size: int) -> None:
    for position in range(max(first_position, 0), len(table) * block_size):
        block, offset = table[position // block_size], position % block_size
        for layer in caches:
            layer[:, block, offset] = POISON


@pytest.mark.parametrize("proposer", ["copy", "unrelated"])
def test_rejected_guesses_kv_is_never_read(spec_checkpoints, reference, proposer):
    """Poisoning every slot past what each model must have computed changes no token, and the
    copy draft is still always accepted: neither model reads a rejected guess's K/V or a slot
    it has not rewritten."""
    draft = spec_checkpoints["target" if proposer == "copy" else "unrelated"]
    engine, recorder = make_engine(spec_checkpoints["target"], speculative_model=draft, num_speculative_tokens=K)
    poison_after_each_step(engine)
    assert tokens(run(engine, PROMPTS, GREEDY)) == reference
    if proposer == "copy":
        assert recorder.spec.draft_acceptance_rate == 1.0
    else:
        assert recorder.spec.accepted_tokens < recorder.spec.draft_tokens  # guesses were rejected


def test_the_poison_is_strong_enough_to_show(spec_checkpoints, reference):
    """The same poison one slot earlier (over the last computed token) changes the output:
    the test above would catch a read."""
    engine, _ = make_engine(spec_checkpoints["target"], speculative_model=spec_checkpoints["unrelated"],
                            num_speculative_tokens=K)
    worker = engine.model_executor.driver_worker
    execute = worker.execute_model

    def too_early(req):
        outputs = list(execute(req))
        for i, metadata in enumerate(req.seq_group_metadata_list):
            emitted = sum(1 for out in outputs if out[i].samples)
            for seq_id, data in metadata.seq_data.items():
                _poison(worker.kv_caches, metadata.block_tables[seq_id], data.get_len() + emitted - 2,
                        worker.cache_config.block_size)
        return outputs

    worker.execute_model = too_early
    assert tokens(run(engine, PROMPTS, GREEDY)) != reference


def test_a_step_whose_sequences_emit_different_counts_gives_each_its_own():
    """Bundled model, n-gram lookup, greedy: in one step some sequences accept more guesses
    than others, and each gets exactly its own tokens (the target's alone)."""
    prompts = [[5, 6, 7, 8] * 6, list(range(20, 44)), [9, 10] * 12]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = tokens(run(make_engine("tiny-shakespeare")[0], prompts, greedy))
    engine, recorder = make_engine("tiny-shakespeare", speculative_model="[ngram]", num_speculative_tokens=K,
                                   ngram_prompt_lookup_max=3)
    emitted_per_step = []
    worker = engine.model_executor.driver_worker
    record = worker.counter.record
    worker.counter.record = lambda proposed, emitted: (emitted_per_step.append(emitted), record(proposed, emitted))
    assert tokens(run(engine, prompts, greedy)) == reference
    assert any(len(set(emitted)) > 1 for emitted in emitted_per_step)
