"""The bundled draft model `tiny-shakespeare-draft`, and the script option that trains one.

The draft must share the target's tokenizer (the same token ids mean the same text) and must
be a good guesser: its acceptance rate against tiny-shakespeare is measured here on a small
greedy workload (the model card reports it on a larger one).
"""

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from minivllm import EngineArgs, LLMEngine, SamplingParams
from minivllm.bundled_models import DEFAULT_MODEL, DRAFT_MODEL, resolve_model

REPO = Path(__file__).resolve().parents[2]


def test_the_draft_shares_the_targets_tokenizer_and_is_smaller():
    target, draft = Path(resolve_model(DEFAULT_MODEL)), Path(resolve_model(DRAFT_MODEL))
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    target_config, draft_config = AutoConfig.from_pretrained(target), AutoConfig.from_pretrained(draft)
    assert draft_config.vocab_size == target_config.vocab_size
    assert draft_config.max_position_embeddings >= target_config.max_position_embeddings
    assert draft_config.num_hidden_layers < target_config.num_hidden_layers
    assert (draft / "model.safetensors").stat().st_size < (target / "model.safetensors").stat().st_size / 4


def test_the_draft_is_accepted_often_and_changes_no_greedy_token():
    torch.set_num_threads(1)
    prompts = ["ROMEO:", "JULIET:", "KING HENRY:", "HAMLET:"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = []
    for spec in ({}, {"speculative_model": DRAFT_MODEL, "num_speculative_tokens": 2}):
        engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", **spec))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        out = {}
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        results.append(out)
    assert results[0] == results[1]
    metrics = engine.model_executor.driver_worker.counter.metrics()
    assert metrics.draft_acceptance_rate > 0.45  # 0.595 on the model card's larger workload (k = 2, greedy)


def test_the_script_trains_a_draft_by_distillation(tmp_path):
    """`--distill-from DIR --size draft`: DIR's tokenizer, the draft's shape, a loadable checkpoint."""
    spec = importlib.util.spec_from_file_location("train_tiny_model", REPO / "scripts" / "train_tiny_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"ROMEO:\nBut soft, what light {i}?\nIt is the east." for i in range(40)) + "\n")
    out = tmp_path / "draft"
    script.main(["--corpus", str(corpus), "--out", str(out), "--device", "cpu", "--distill-from",
                 resolve_model(DEFAULT_MODEL), "--size", "draft", "--steps", "2", "--batch-size", "2",
                 "--block-size", "32", "--eval-interval", "2", "--max-eval-windows", "2"])
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 2, 4096)
    assert (out / "tokenizer.json").read_bytes() == (Path(resolve_model(DEFAULT_MODEL)) / "tokenizer.json").read_bytes()
