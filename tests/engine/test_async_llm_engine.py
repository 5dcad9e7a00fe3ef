"""`AsyncLLMEngine` on the real engine and the bundled model: streaming, abort, isolation.

The reference is the same `LLMEngine` driven synchronously (`add_request` + `step` until
done), so the async layer must add nothing and lose nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine, AsyncStream, EngineStepError
from minivllm.sampling_params import SamplingParams

PROMPT = "ROMEO:"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    args = EngineArgs(device="cpu", seed=0, max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=64, swap_space=0.01)
    async_engine = AsyncLLMEngine.from_engine_args(args)
    yield async_engine
    async_engine.shutdown()


def run(engine: AsyncLLMEngine, coroutine):
    """Run a test body on a fresh event loop, then stop the engine loop cleanly."""

    async def main():
        try:
            return await coroutine
        finally:
            await engine.stop_background_loop()

    return asyncio.run(main())


def sync_generate(llm_engine, request_id, prompt, params):
    """The reference: drive the same engine by hand, no asyncio."""
    llm_engine.add_request(request_id, prompt, params)
    final = None
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    return final


def all_blocks_free(engine: AsyncLLMEngine) -> bool:
    llm_engine = engine.engine
    free = llm_engine.scheduler.block_manager.get_num_free_gpu_blocks()
    return not llm_engine.has_unfinished_requests() and free == llm_engine.cache_config.num_gpu_blocks


async def collect(engine, request_id, prompt=PROMPT, params=GREEDY):
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_generate_streams_what_the_sync_engine_computes(engine):
    expected = sync_generate(engine.engine, "sync-0", PROMPT, GREEDY)
    outputs = run(engine, collect(engine, "async-0"))
    texts = [o.outputs[0].text for o in outputs]
    assert len(outputs) == GREEDY.max_tokens  # one output per step, as tokens arrive
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))  # cumulative text grows
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert outputs[-1].outputs[0].text == expected.outputs[0].text
    assert all_blocks_free(engine)


def test_concurrent_requests_each_get_their_own_stream(engine):
    prompts = ["ROMEO:", "JULIET:", "Enter HAMLET.", "First Citizen:"]
    expected = [sync_generate(engine.engine, f"sync-{i}", p, GREEDY).outputs[0].text for i, p in enumerate(prompts)]

    async def body():
        return await asyncio.gather(*(collect(engine, f"c-{i}", p) for i, p in enumerate(prompts)))

    results = run(engine, body())
    assert [r[-1].outputs[0].text for r in results] == expected
    assert all(r[-1].request_id == f"c-{i}" for i, r in enumerate(results))
    assert all_blocks_free(engine)


def test_abort_ends_the_stream_and_frees_blocks(engine):
    async def body():
        seen = []
        async for output in engine.generate(PROMPT, LONG, "to-abort"):
            seen.append(output)
            if len(seen) == 3:
                await engine.abort("to-abort")
        await asyncio.sleep(0.1)  # the abort reaches the engine before its next step
        return seen

    seen = run(engine, body())
    assert 3 <= len(seen) < LONG.max_tokens and not seen[-1].finished
    assert all_blocks_free(engine)


def test_a_caller_that_stops_listening_aborts_its_request(engine):
    async def body():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, LONG, "walks-away"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()  # what a dropped HTTP client does to its handler
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        return engine.engine.has_unfinished_requests()

    assert run(engine, body()) is False
    assert all_blocks_free(engine)


def test_a_rejected_request_fails_only_its_caller(engine):
    async def body():
        good = asyncio.create_task(collect(engine, "good"))
        with pytest.raises(ValueError):
            await collect(engine, "empty", prompt={"prompt_token_ids": []})  # the engine refuses it
        twin = asyncio.create_task(collect(engine, "twin"))
        await asyncio.sleep(0)  # let the first "twin" register
        with pytest.raises(ValueError, match="already exists"):
            await collect(engine, "twin")
        assert (await twin)[-1].finished
        return await good

    outputs = run(engine, body())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
    assert all_blocks_free(engine)


def test_a_failing_step_aborts_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    real_step = engine.engine.step
    calls = {"n": 0}

    def step_failing_once(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_step(*args)

    monkeypatch.setattr(engine.engine, "step", step_failing_once)

    async def body():
        with pytest.raises(EngineStepError, match="injected fault"):
            await collect(engine, "victim", params=LONG)
        assert engine.is_running  # the loop survived
        return await collect(engine, "after")

    outputs = run(engine, body())
    assert outputs[-1].finished
    assert all_blocks_free(engine)


def test_stopping_the_loop_aborts_everything(engine):
    async def body():
        tasks = [asyncio.create_task(collect(engine, f"s-{i}", params=LONG)) for i in range(3)]
        await asyncio.sleep(0.2)
        await engine.stop_background_loop()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(engine, body())
    assert all(isinstance(r, EngineStepError) for r in results)
    assert all_blocks_free(engine)


def test_closing_the_event_loop_mid_request_leaves_nothing_behind(engine):
    """asyncio.run cancels the loop task when its body returns early; the cleanup still runs."""

    async def leave_early():
        async for _ in engine.generate(PROMPT, LONG, "orphan"):
            return  # returning closes this loop with the request still running

    asyncio.run(leave_early())
    assert not engine.is_running
    assert all_blocks_free(engine)


def test_health_check_reports_a_dead_loop_and_the_next_request_restarts_it(engine, monkeypatch):
    def broken():
        raise RuntimeError("scheduler state corrupted")

    async def kill_the_loop():
        monkeypatch.setattr(engine.engine, "has_unfinished_requests", broken)
        engine.start_background_loop()
        await asyncio.sleep(0.05)  # the loop's first check raises outside any step
        monkeypatch.undo()
        assert engine.errored and not engine.is_running
        with pytest.raises(RuntimeError, match="loop died"):
            await engine.check_health()
        outputs = await collect(engine, "revived")  # a new request starts a new loop
        await engine.check_health()
        return outputs

    assert run(engine, kill_the_loop())[-1].finished
    assert all_blocks_free(engine)


def test_streaming_with_multi_step_stays_token_by_token_and_matches_single_step():
    """num_scheduler_steps=4: an engine step makes up to 4 tokens, yet the stream gets them one
    at a time (each model step's outputs are delivered as it ends); the text is the same."""
    args = EngineArgs(device="cpu", seed=0, max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=64,
                      swap_space=0.01, num_scheduler_steps=4)
    multi = AsyncLLMEngine.from_engine_args(args)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    try:
        outputs = run(multi, collect(multi, "m", params=params))
        expected = sync_generate(multi.engine.__class__.from_engine_args(
            EngineArgs(device="cpu", seed=0, max_model_len=256, num_gpu_blocks_override=64)), "s", PROMPT, params)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == list(range(1, 31))
        assert multi.engine.step_counter < 15  # yet the engine ran several tokens per step
        assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == expected.outputs[0].text
        assert all_blocks_free(multi)
    finally:
        multi.shutdown()


def test_a_merging_stream_hands_a_reader_that_fell_behind_only_the_newest_output():
    from minivllm.engine.multiprocessing.client import MergingAsyncStream
    from minivllm.outputs import CompletionOutput, RequestOutput

    def cumulative(n: int) -> RequestOutput:
        return RequestOutput("r", None, [1], None, [CompletionOutput(0, "x" * n, [7] * n, None, None)], False)

    async def body(merge: bool):
        stream_class = MergingAsyncStream if merge else AsyncStream
        stream = stream_class("r", on_cancel=lambda _: None)
        reader = stream.generator()
        stream.put(cumulative(1))
        first = await reader.__anext__()  # kept up: one output
        for n in (2, 3, 4):  # fell behind by three steps
            stream.put(cumulative(n))
        stream.finish()
        return [first] + [output async for output in reader]

    merged, every = asyncio.run(body(True)), asyncio.run(body(False))
    assert [len(o.outputs[0].token_ids) for o in merged] == [1, 4]  # caught up in one chunk
    assert [len(o.outputs[0].token_ids) for o in every] == [1, 2, 3, 4]


def test_a_merging_stream_of_deltas_appends_what_queued_up():
    """DELTA outputs (the server's streams) merge by appending: nothing a skipped one said is lost."""
    from minivllm.engine.multiprocessing.client import MergingAsyncStream
    from minivllm.outputs import CompletionOutput, RequestOutput

    def delta(token: int, finish=None) -> RequestOutput:
        completions = [CompletionOutput(i, f"<{token}.{i}>", [token], -1.0 * token, [{token: -1.0}], finish)
                       for i in (0, 1)]
        return RequestOutput("r", None, [1], None, completions, finish is not None)

    async def body():
        stream = MergingAsyncStream("r", on_cancel=lambda _: None, delta=True)
        reader = stream.generator()
        stream.put(delta(1))
        first = await reader.__anext__()
        for token in (2, 3):
            stream.put(delta(token))
        stream.put(delta(4, finish="length"))
        stream.finish()
        return [first] + [output async for output in reader]

    first, merged = asyncio.run(body())
    assert [c.token_ids for c in first.outputs] == [[1], [1]]
    assert [c.text for c in merged.outputs] == ["<2.0><3.0><4.0>", "<2.1><3.1><4.1>"]
    assert all(c.token_ids == [2, 3, 4] and len(c.logprobs) == 3 for c in merged.outputs)
    assert merged.finished and [c.finish_reason for c in merged.outputs] == ["length"] * 2
    assert merged.outputs[0].cumulative_logprob == -4.0  # the newest
