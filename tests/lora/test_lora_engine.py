"""Greedy output with adapters equals the PEFT-merged transformers model (fp32): each adapter
alone, a batch mixing two adapters and the base model, under prefix caching (the same
prompt under two adapters must not share KV) and with max_loras=1 (the scheduler takes the
adapters in turns). The "triton" backend runs the LoRA kernels (in Triton's interpreter on
a CPU)."""

from __future__ import annotations

import pytest
import torch

import engine_test_checkpoints as checkpoints
from minivllm.entrypoints.llm import LLM
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = {"max_loras": 2, "max_lora_rank": 8, "device": "cpu", **kwargs}
    return LLM(path, enable_lora=True, dtype="float32", block_size=8, **kwargs)


def generate(llm: LLM, prompts: list[list[int]], loras) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def requests(adapters):
    return {"all": LoRARequest("all", 1, adapters["all"].path), "some": LoRARequest("some", 2, adapters["some"].path)}


@pytest.mark.parametrize("name", ["all", "some"])
def test_each_adapter_alone_equals_the_merged_model(lora_base, adapters, requests, name):
    path, base = lora_base
    prompts = checkpoints.mixed_prompts(3, seed=1, max_len=20)
    got = generate(make_llm(path), prompts, requests[name])
    assert got == [checkpoints.hf_greedy(adapters[name].merged, p, MAX_TOKENS) for p in prompts]
    # ...and differs from the base model's, so the adapter is really applied.
    assert got != [checkpoints.hf_greedy(base, p, MAX_TOKENS) for p in prompts]


def _mixed_case(lora_base, adapters, requests):
    _, base = lora_base
    prompts = checkpoints.mixed_prompts(6, seed=2, max_len=20)
    loras = [requests["all"], None, requests["some"], requests["some"], None, requests["all"]]
    models = {None: base, "all": adapters["all"].merged, "some": adapters["some"].merged}
    expected = [checkpoints.hf_greedy(models[r.lora_name if r else None], p, MAX_TOKENS)
                for p, r in zip(prompts, loras)]
    return prompts, loras, expected


@pytest.mark.parametrize("kwargs", [{}, {"max_loras": 1},
                                    {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 8},
                                    {"num_scheduler_steps": 4}],
                         ids=["torch", "max_loras=1", "chunked-prefill", "multi-step"])
def test_a_batch_mixing_two_adapters_and_the_base_model(lora_base, adapters, requests, kwargs):
    prompts, loras, expected = _mixed_case(lora_base, adapters, requests)
    llm = make_llm(lora_base[0], **kwargs)
    assert generate(llm, prompts, loras) == expected
    checkpoints.assert_all_blocks_free(llm.llm_engine)


def test_triton_kernels_in_the_engine(lora_base, adapters, requests):
    """The "triton" backend: the LoRA layers call lora_ops' kernels (short, for the interpreter),
    on the GPU where there is one (the interpreter serves only a CPU-only machine)."""
    _, base = lora_base
    prompts = checkpoints.mixed_prompts(3, seed=5, max_len=10)
    loras = [requests["all"], None, requests["some"]]
    models = [adapters["all"].merged, base, adapters["some"].merged]
    llm = make_llm(lora_base[0], attention_backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    assert llm.llm_engine.model_executor.driver_worker.model_runner.lora_manager.manager.punica.shrink.__module__ \
        == "minivllm.kernels.lora_ops"
    got = generate(llm, prompts, loras)
    assert got == [checkpoints.hf_greedy(m, p, MAX_TOKENS) for m, p in zip(models, prompts)]
    checkpoints.assert_all_blocks_free(llm.llm_engine)


def test_the_same_prompt_under_two_adapters_shares_no_kv(lora_base, adapters, requests):
    """With prefix caching, a prompt already cached for one adapter is a miss for another (its
    KV differs), and a hit again for the first."""
    path, base = lora_base
    prompt = checkpoints.mixed_prompts(7, seed=3, max_len=33)[-1]  # 33 tokens: 4 full blocks of 8
    llm = make_llm(path, enable_prefix_caching=True)
    engine = llm.llm_engine
    outputs = {}
    for name in ["all", "some", None, "all"]:
        lora = requests[name] if name else None
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora, use_tqdm=False)[0]
        outputs.setdefault(name, []).append((out.outputs[0].token_ids, out.num_cached_tokens))
    assert [cached for _, cached in outputs["all"]] == [0, 32]  # a hit only for its own adapter
    assert outputs["some"][0][1] == 0 and outputs[None][0][1] == 0
    merged = {None: base, "all": adapters["all"].merged, "some": adapters["some"].merged}
    for name, runs in outputs.items():
        for tokens, _ in runs:
            assert tokens == checkpoints.hf_greedy(merged[name], prompt, MAX_TOKENS)
    checkpoints.assert_all_blocks_free(engine)


def test_more_adapters_than_slots_and_cpu_cache(lora_base, adapters, requests, tmp_path):
    """Three adapter ids over one GPU slot and a CPU cache of one: every request still gets its
    own adapter (slots and the CPU cache evict the least recently used)."""
    path, base = lora_base
    third = LoRARequest("all-again", 3, adapters["all"].path)  # same weights under another id
    llm = make_llm(path, max_loras=1, max_cpu_loras=1)
    prompts = checkpoints.mixed_prompts(5, seed=4, max_len=12)[1:]
    loras = [requests["all"], requests["some"], third, requests["some"]]
    names = ["all", "some", "all", "some"]
    expected = [checkpoints.hf_greedy(adapters[n].merged, p, MAX_TOKENS) for p, n in zip(prompts, names)]
    assert generate(llm, prompts, loras) == expected
    manager = llm.llm_engine.model_executor.driver_worker.model_runner.lora_manager
    assert len(manager.cpu_cache) == 1 and len(manager.manager.slots) == 1


def test_tensor_parallel_two_ranks_over_gloo(lora_base, adapters, requests):
    """TP=2 in two processes (the mp executor, gloo): each rank applies its shard of the
    adapters; the mixed batch still equals the merged models."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    _, base = lora_base
    prompts = checkpoints.mixed_prompts(3, seed=6, max_len=12)
    loras = [requests["all"], None, requests["some"]]
    models = [adapters["all"].merged, base, adapters["some"].merged]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=lora_base[0], device="cpu", dtype="float32", block_size=8, tensor_parallel_size=2, enable_lora=True,
        max_loras=2, max_lora_rank=8))
    try:
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
        results = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[int(output.request_id)] = output.outputs[0].token_ids
        assert [results[i] for i in range(3)] == [checkpoints.hf_greedy(m, p, MAX_TOKENS) for m, p in zip(models, prompts)]
        checkpoints.assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_removing_an_adapter_keeps_the_slots_dense(lora_base, adapters, requests):
    """Slots stay 0..n-1: removing the adapter in slot 0 moves the last slot's adapter into it,
    and requests of the adapters left still get their merged models' tokens."""
    llm = make_llm(lora_base[0], max_loras=3, max_cpu_loras=3)
    worker_manager = llm.llm_engine.model_executor.driver_worker.model_runner.lora_manager
    manager = worker_manager.manager
    third = LoRARequest("all-again", 3, adapters["all"].path)
    for request in (requests["all"], requests["some"], third):
        manager.activate(worker_manager.get(request), keep=set())
    assert dict(manager.slots) == {1: 0, 2: 1, 3: 2}
    worker_manager.remove_adapter(1)
    assert dict(manager.slots) == {2: 1, 3: 0} and worker_manager.list_adapters() == [2, 3]
    for layer in manager.lora_layers.values():  # slot 2 is empty again
        assert not layer.lora_a_stacked[2].any() and not any(b[2].any() for b in layer.lora_b)
    prompts = checkpoints.mixed_prompts(3, seed=9, max_len=12)[1:]
    got = generate(llm, prompts, [third, requests["some"]])
    assert got == [checkpoints.hf_greedy(adapters[name].merged, p, MAX_TOKENS) for name, p in zip(["all", "some"], prompts)]
