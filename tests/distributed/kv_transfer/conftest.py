"""Engines with and without a KV connector, on the bundled model on a CPU, and a Redis server.

`run` drives an engine to the end and checks the rule every test needs: when no request is
left, every block is back in the pool. Test files `import kv_transfer_testing` (this module:
pytest's importlib mode keeps tests/ off sys.path).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.bundled_models import resolve_model
from minivllm.config import KVTransferConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

BLOCK_SIZE = 8
# Prompts of several blocks; the first two share a prefix of more than two blocks.
PROMPTS = [
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet",
    "ROMEO: But soft, what light through yonder window breaks? Arise, fair sun, and kill",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name",
    "MERCUTIO: Nay, gentle Romeo, we must have you dance.",
]
MAX_TOKENS = 12


def make_engine(kv_transfer_config: KVTransferConfig | None = None, **kwargs) -> LLMEngine:
    args = dict(device="cpu", block_size=BLOCK_SIZE, max_model_len=256, num_gpu_blocks_override=96,
                kv_transfer_config=kv_transfer_config)
    args.update(kwargs)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run(engine: LLMEngine, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> dict[str, tuple]:
    """request id -> (output token ids, num_cached_tokens); asserts every block came back."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = (output.outputs[0].token_ids, output.num_cached_tokens)
    block_manager = engine.scheduler.block_manager
    assert block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    assert not block_manager.block_tables
    return results


def tokens(results: dict[str, tuple]) -> dict[str, list[int]]:
    return {rid: list(toks) for rid, (toks, _) in results.items()}


def full_blocks_before_last_token(engine: LLMEngine, prompt: str) -> int:
    """Tokens a store can supply for `prompt`: its full blocks, not the last token's."""
    num_tokens = len(engine.tokenizer.encode(prompt))
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="session")
def reference() -> dict[str, list[int]]:
    """Greedy tokens of an engine with no connector."""
    return tokens(run(make_engine()))


def checkpoint_copy(folder, seed: int | None = None):
    """The bundled checkpoint copied to `folder`; with a seed, its weights moved by noise (as
    large as each tensor's spread): a model of the same shapes that computes other KV."""
    folder = Path(folder)
    shutil.copytree(resolve_model(None), folder, dirs_exist_ok=True)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        weights = load_file(folder / "model.safetensors")
        for name, w in weights.items():
            weights[name] = w + torch.randn(w.shape, generator=generator) * w.float().std()
        save_file(weights, folder / "model.safetensors")
    return folder


def shared_storage(path, role: str = "kv_both", **extra) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", role, {"shared_storage_path": str(path), **extra})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throw-away redis-server on a free port (killed at the end, or by a test)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `apt-get install redis-server` (.ci/run does it).")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"redis-server did not start on port {self.port}.")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.kill()


sys.modules.setdefault("kv_transfer_testing", sys.modules[__name__])
