"""Prefill-decode disaggregation on loopback: a producer prefills, a consumer decodes from the
producer's KV, and the tokens are those of one engine doing both."""

from __future__ import annotations

import json

import pytest

import kv_transfer_testing as kvt
from minivllm.sampling_params import SamplingParams
from minivllm.worker.multi_step_model_runner import MultiStepModelRunner


@pytest.mark.parametrize("consumer_steps", [1, 4], ids=["one-step", "multi-step consumer"])
def test_producer_hands_off_to_consumer(tmp_path, reference, consumer_steps, monkeypatch):
    """The consumer loads in its prefill steps and decodes; with multi-step its decode runs
    move no KV (the connector is not called) and give the same tokens."""
    multi_step_runs = []
    run_steps = MultiStepModelRunner.execute_model
    monkeypatch.setattr(MultiStepModelRunner, "execute_model",
                        lambda self, *args: (multi_step_runs.append(1), run_steps(self, *args))[1])
    producer = kvt.make_engine(kvt.shared_storage(tmp_path, "kv_producer"))
    first_tokens = kvt.run(producer, max_tokens=1)
    assert {rid: toks for rid, toks in kvt.tokens(first_tokens).items()} == \
        {rid: toks[:1] for rid, toks in reference.items()}
    assert producer.kv_transfer_stats.num_tokens_saved > 0 and producer.kv_transfer_stats.num_tokens_loaded == 0
    consumer = kvt.make_engine(kvt.shared_storage(tmp_path, "kv_consumer"), num_scheduler_steps=consumer_steps)
    files_before = sorted(tmp_path.rglob("*.kv"))
    decoded = kvt.run(consumer)
    assert kvt.tokens(decoded) == reference
    assert bool(multi_step_runs) == (consumer_steps > 1)
    for rid, (_, cached) in decoded.items():  # the consumer computed only each prompt's last block
        assert cached == kvt.full_blocks_before_last_token(consumer, kvt.PROMPTS[int(rid)])
    assert consumer.kv_transfer_stats.num_tokens_saved == 0  # a consumer never writes
    assert sorted(tmp_path.rglob("*.kv")) == files_before


def test_proxy_between_two_servers_matches_one_server(tmp_path):
    """Three servers on loopback: a plain one, a producer and a consumer behind `minivllm
    proxy`'s app. The proxy's answers (plain and streamed) are the plain server's."""
    pytest.importorskip("httpx")
    import httpx

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.async_llm_engine import AsyncLLMEngine
    from minivllm.entrypoints.disagg_proxy import build_proxy_app
    from minivllm.entrypoints.openai.api_server import ServerThread, build_app

    def server(kv_transfer_config=None):
        args = EngineArgs(device="cpu", block_size=kvt.BLOCK_SIZE, max_model_len=256, num_gpu_blocks_override=96,
                          kv_transfer_config=kv_transfer_config)
        return ServerThread(build_app(AsyncLLMEngine.from_engine_args(args), "tiny"))

    with server() as single, server(kvt.shared_storage(tmp_path, "kv_producer")) as prefill, \
            server(kvt.shared_storage(tmp_path, "kv_consumer")) as decode, \
            ServerThread(build_proxy_app(prefill.url, decode.url), port=0) as proxy:
        for prompt in kvt.PROMPTS[:3]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": kvt.MAX_TOKENS, "temperature": 0}
            expected = httpx.post(single.url + "/v1/completions", json=body).json()["choices"][0]["text"]
            answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["text"] == expected
            with httpx.stream("POST", proxy.url + "/v1/completions", json={**body, "stream": True}) as stream:
                events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
        engines = [s.app.state.engine.engine for s in (prefill, decode)]
        assert engines[0].kv_transfer_stats.num_tokens_saved > 0
        assert engines[1].kv_transfer_stats.num_tokens_loaded > 0 and engines[1].kv_transfer_stats.num_tokens_saved == 0
        loaded = engines[1].kv_transfer_stats.num_tokens_loaded
        metrics = httpx.get(decode.url + "/metrics").text  # the Prometheus gauges follow the stats
        assert f'vllm:kv_transfer_num_tokens_loaded{{model_name="tiny"}} {float(loaded)}' in metrics
        bad = httpx.post(proxy.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400  # the prefill server's answer, passed through
