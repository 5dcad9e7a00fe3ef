"""ModelRunner: the flattened batch, worked by hand from the slot formula
slot = block_table[pos // block_size] * block_size + pos % block_size."""

import pytest
import torch

from minivllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceData, SequenceGroupMetadata
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.cuda_graph_runner import CUDAGraphModelRunner
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.worker import Worker

BLOCK_SIZE = 4


def make_runner(llama_dir, max_num_seqs=8, load=True) -> ModelRunner:
    model_config = ModelConfig(model=llama_dir[0])
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=64, max_num_batched_tokens=64)
    runner = ModelRunner(EngineConfig(model_config, CacheConfig(block_size=BLOCK_SIZE), scheduler_config))
    if load:
        runner.load_model()
    return runner


def group(request_id, seq_id, tokens, num_computed, block_table, is_prompt, chunk, params=None, do_sample=True):
    data = SequenceData(tokens[:5], tokens[5:]) if not is_prompt else SequenceData(list(tokens))
    data.num_computed_tokens = num_computed
    return SequenceGroupMetadata(request_id, is_prompt, {seq_id: data}, params or SamplingParams(temperature=0.0),
                                 {seq_id: block_table}, chunk, do_sample)


def test_mixed_batch_is_flattened_prefills_first(llama_dir):
    runner = make_runner(llama_dir, load=False)
    a = group("A", 0, list(range(10, 17)), 3, [7, 2], True, 4)   # prompt of 7: 3 cached + 4 new
    b = group("B", 1, list(range(20, 30)), 9, [1, 5, 6], False, 1)  # 10 tokens: decode the 10th
    c = group("C", 2, list(range(30, 36)), 5, [3, 4], False, 1)     # 6 tokens: decode the 6th
    batch = runner.prepare_model_input([a, b, c])
    md = batch.attn_metadata
    assert batch.input_ids.tolist() == [13, 14, 15, 16, 29, 35]
    assert batch.positions.tolist() == [3, 4, 5, 6, 9, 5]
    # A: pos 3 -> block 7 slot 3 = 31; pos 4, 5, 6 -> block 2 slots 0-2 = 8, 9, 10.
    # B: pos 9 -> block_table[2] = 6, slot 1 -> 25.  C: pos 5 -> block_table[1] = 4, slot 1 -> 17.
    assert md.slot_mapping.tolist() == [31, 8, 9, 10, 25, 17]
    assert md.seq_lens.tolist() == [7, 10, 6]
    assert md.query_start_loc.tolist() == [0, 4, 5, 6]
    assert md.block_tables.tolist() == [[7, 2, 0], [1, 5, 6], [3, 4, 0]]
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (1, 4, 2)
    assert (md.max_query_len, md.max_seq_len) == (4, 10)
    # Logits only for the last token of each sequence.
    assert batch.sampling_metadata.selected_token_indices.tolist() == [3, 4, 5]


def test_a_prompt_chunk_short_of_the_end_samples_nothing_but_may_want_prompt_logprobs(llama_dir):
    runner = make_runner(llama_dir, load=False)
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    chunk = group("A", 0, list(range(10, 20)), 4, [0, 1, 2], True, 3, params, do_sample=False)
    batch = runner.prepare_model_input([chunk])
    [to_sample] = batch.sampling_metadata.seq_groups
    assert to_sample.sample_indices == []
    # Rows 0, 1, 2 (positions 4, 5, 6) predict prompt tokens 5, 6, 7.
    assert batch.sampling_metadata.selected_token_indices.tolist() == [0, 1, 2]
    assert to_sample.prompt_logprob_token_ids == [15, 16, 17]


def test_decodes_before_prefills_are_rejected_by_prepare(llama_dir):
    runner = make_runner(llama_dir, load=False)
    decode = group("B", 1, list(range(20, 30)), 9, [1, 5, 6], False, 1)
    prefill = group("A", 0, list(range(10, 17)), 0, [7, 2], True, 7)
    with pytest.raises(ValueError, match="prefill"):
        runner.prepare_model_input([decode, prefill])


def test_mixed_batch_gives_each_group_transformers_next_token(llama_dir):
    """A prefill and a decode in one step (prefills first: the scheduler's order, which the
    runner keeps; a misordered batch is rejected, see above): outputs in batch order."""
    runner = make_runner(llama_dir)
    model_config = runner.model_config
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = 16, 0
    kv_caches = CacheEngine(cache_config, model_config, "cpu", torch.float32).gpu_cache
    first = group("first", 0, [5, 6, 7, 8, 9], 0, [0, 1], True, 5)
    [out] = runner.execute_model([first], kv_caches)
    first.seq_data[0].num_computed_tokens = 5
    first.seq_data[0].append_token_id(out.samples[0].output_token, 0.0)
    decode = SequenceGroupMetadata("first", False, first.seq_data, first.sampling_params, first.block_tables, 1)
    second = group("second", 1, [11, 12, 13], 0, [2], True, 3)
    outputs = runner.execute_model([second, decode], kv_caches)
    assert [o.samples[0].parent_seq_id for o in outputs] == [1, 0]
    hf_model = llama_dir[1]
    with torch.no_grad():
        expected_decode = hf_model(torch.tensor([[5, 6, 7, 8, 9, out.samples[0].output_token]])).logits[0, -1].argmax()
        expected_second = hf_model(torch.tensor([[11, 12, 13]])).logits[0, -1].argmax()
    assert outputs[1].samples[0].output_token == int(expected_decode)
    assert outputs[0].samples[0].output_token == int(expected_second)


def test_profile_run_needs_no_kv_cache(llama_dir):
    make_runner(llama_dir).profile_run()


def test_cuda_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs(llama_dir):
    scheduler_config = SchedulerConfig(max_num_seqs=40, max_model_len=64, max_num_batched_tokens=64)
    config = EngineConfig(ModelConfig(model=llama_dir[0]), CacheConfig(block_size=BLOCK_SIZE), scheduler_config)
    assert CUDAGraphModelRunner(config).graph_batch_sizes() == [1, 2, 4, 8, 16, 32, 40]
    assert type(Worker(config).model_runner) is ModelRunner  # no graphs on a CPU


@pytest.mark.parametrize("budget,sizes", [(64, [64]), (2048, [512, 1024, 1536, 2048]),
                                          (1300, [512, 1024, 1300]), (16384, [512 * i for i in range(1, 9)])])
def test_prefill_graph_token_counts_cover_the_step_budget_up_to_4096(llama_dir, budget, sizes):
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=budget)
    config = EngineConfig(ModelConfig(model=llama_dir[0]), CacheConfig(block_size=BLOCK_SIZE), scheduler_config)
    assert CUDAGraphModelRunner(config).prefill_graph_sizes() == sizes


class _Recorded:
    """A stand-in graph runner: records which graph a batch replayed."""

    def __init__(self, size, calls):
        self.size, self.calls = size, calls

    def replay(self, input_ids, positions, md):
        self.calls.append(self.size)
        return input_ids


def test_each_batch_replays_the_smallest_graph_of_its_kind_that_holds_it(llama_dir, monkeypatch):
    """Decode-only batches pick a decode graph by batch size, prefill-only batches a prefill
    graph by token count; a mixed batch, or one too big for every graph, runs eagerly."""
    scheduler_config = SchedulerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    config = EngineConfig(ModelConfig(model=llama_dir[0]), CacheConfig(block_size=BLOCK_SIZE), scheduler_config)
    runner, calls = CUDAGraphModelRunner(config), []
    runner.graph_runners = {s: _Recorded(("decode", s), calls) for s in (1, 2, 4)}
    runner.prefill_graph_runners = {s: _Recorded(("prefill", s), calls) for s in (16, 32)}
    monkeypatch.setattr(ModelRunner, "run_model", lambda self, ids, *args: calls.append("eager"))
    prompt = lambda i, n: group(str(i), i, list(range(n)), 0, list(range(4 * i, 4 * i + 4)), True, n)  # noqa: E731
    decode = lambda i: group(str(i), i, list(range(10, 16)), 5, [i, i + 8], False, 1)  # noqa: E731
    for batch in ([decode(0)], [decode(0), decode(1), decode(2)], [prompt(0, 5), prompt(1, 11)],
                  [prompt(0, 16), prompt(1, 16)], [prompt(0, 13), decode(1)]):
        md = runner.prepare_model_input(batch)
        runner.run_model(md.input_ids, md.positions, md.attn_metadata, [])
    assert calls == [("decode", 1), ("decode", 4), ("prefill", 16), ("prefill", 32), "eager"]
    too_long = runner.prepare_model_input([prompt(0, 16), prompt(1, 16), prompt(2, 2)])  # 34 tokens
    runner.run_model(too_long.input_ids, too_long.positions, too_long.attn_metadata, [])
    assert calls[-1] == "eager"


def graphed_runner(llama_dir) -> tuple[CUDAGraphModelRunner, list[torch.Tensor]]:
    """A CUDA-graph runner (fp32) over a random cache, its graphs captured."""
    model_config = ModelConfig(model=llama_dir[0], dtype="float32")
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64)
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = 32, 0
    runner = CUDAGraphModelRunner(EngineConfig(model_config, cache_config, scheduler_config, DeviceConfig("cuda")))
    runner.load_model()
    kv_caches = CacheEngine(cache_config, model_config, "cuda", runner.dtype).gpu_cache
    for layer in kv_caches:
        layer.normal_()
    runner.capture_model(kv_caches)
    return runner, kv_caches


def graph_and_eager(runner, kv_caches, groups) -> tuple[torch.Tensor, torch.Tensor]:
    batch = runner.prepare_model_input(groups)
    with torch.inference_mode():  # as in execute_model: the graph's buffers are inference tensors
        graph_out = runner.run_model(batch.input_ids, batch.positions, batch.attn_metadata, kv_caches).clone()
        eager_out = runner.model(batch.input_ids, batch.positions, kv_caches, batch.attn_metadata)
    return graph_out, eager_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager(llama_dir):
    """The replayed graph (padded batch of 3 -> 4) gives the eager forward's hidden states."""
    runner, kv_caches = graphed_runner(llama_dir)
    graph_out, eager_out = graph_and_eager(runner, kv_caches, [
        group(str(i), i, list(range(3, 3 + 6 + i)), 5 + i, [3 * i, 3 * i + 1, 3 * i + 2], False, 1) for i in range(3)
    ])
    torch.testing.assert_close(graph_out, eager_out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_prefill_matches_eager(llama_dir):
    """Prefills of 3 sequences (one after a cached prefix), 21 tokens padded to the graph's 64,
    give the eager forward's hidden states; the graph replays again for another split."""
    runner, kv_caches = graphed_runner(llama_dir)
    assert sorted(runner.prefill_graph_runners) == [64]
    replays, graph = [], runner.prefill_graph_runners[64]
    graph.replay = lambda *args, _replay=graph.replay: (replays.append(1), _replay(*args))[1]
    for groups in ([group("A", 0, list(range(3, 10)), 0, [1, 2], True, 7),
                    group("B", 1, list(range(20, 30)), 4, [3, 4, 5], True, 6),
                    group("C", 2, list(range(40, 48)), 0, [6, 7], True, 8)],
                   [group("D", 3, list(range(5, 45)), 0, list(range(8, 18)), True, 40)]):
        graph_out, eager_out = graph_and_eager(runner, kv_caches, groups)
        torch.testing.assert_close(graph_out, eager_out, rtol=1e-4, atol=1e-4)
    assert len(replays) == 2
