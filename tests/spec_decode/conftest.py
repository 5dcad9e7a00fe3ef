"""Fixtures for the speculative-decoding tests: a tiny random target, an exact copy of it as a
draft, an unrelated draft with the same vocabulary, and one with another vocabulary."""

import logging
import sys

import pytest
import torch

# Tiny models: a second intra-op thread only adds synchronisation (see tests/engine/conftest.py).
torch.set_num_threads(1)

checkpoints = sys.modules["engine_test_checkpoints"]  # registered by tests/conftest.py


@pytest.fixture(scope="session")
def spec_checkpoints(tmp_path_factory):
    """name -> folder: "target" (seed 0), "unrelated" (seed 1, same shape and vocabulary),
    "other_vocab" (a vocabulary of 64 tokens)."""
    root = tmp_path_factory.mktemp("spec-checkpoints")
    checkpoints.save_checkpoint("llama", root / "target", seed=0)
    checkpoints.save_checkpoint("llama", root / "unrelated", seed=1)
    model = checkpoints.build_hf_model("llama", seed=2)
    model.resize_token_embeddings(64)
    model.config.vocab_size = 64
    model.save_pretrained(root / "other_vocab")
    checkpoints.build_tokenizer().save_pretrained(root / "other_vocab")
    return {name: str(root / name) for name in ("target", "unrelated", "other_vocab")}


@pytest.fixture(autouse=True)
def no_step_failed(caplog):
    """Every speculative step completes: the engine's failure isolation would otherwise rerun a
    failed batch one request at a time and hide the error behind correct tokens."""
    with caplog.at_level(logging.WARNING, logger="minivllm.engine.failure_isolation"):
        yield
    failures = [r.getMessage() for r in caplog.get_records("call") if r.name == "minivllm.engine.failure_isolation"]
    assert not failures, failures
