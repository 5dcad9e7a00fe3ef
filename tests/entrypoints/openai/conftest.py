"""One real server for this directory: the bundled model behind uvicorn on a free loopback port.

Small limits keep it fast on two CPU cores: a short context, few sequences per step and a
small KV pool, so the load test also exercises queueing.
"""

from __future__ import annotations

import time

import pytest

# The server needs the `serve` extra and the client the `dev` extra (CI installs both). A
# machine without them (the lent GPU machine has no FastAPI) skips this directory instead of
# failing to import it.
for _module in ("fastapi", "uvicorn", "prometheus_client", "openai"):
    pytest.importorskip(_module)

import openai  # noqa: E402

from minivllm.engine.arg_utils import EngineArgs  # noqa: E402
from minivllm.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

MODEL_NAME = "tiny-shakespeare"
ENGINE_KWARGS = dict(
    model=None,  # the bundled model
    device="cpu",
    seed=0,
    max_model_len=256,
    max_num_seqs=16,
    block_size=16,
    num_gpu_blocks_override=128,
    swap_space=0.01,
)


@pytest.fixture(scope="session")
def server():
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**ENGINE_KWARGS))
    with ServerThread(build_app(engine, MODEL_NAME)) as running:
        yield running
    engine.shutdown()


@pytest.fixture(scope="session")
def engine(server) -> AsyncLLMEngine:
    return server.app.state.engine


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    # No retries: a 5xx must show up as a failure, not be papered over.
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def llm():
    """The offline `LLM` on the same model and limits: the reference for greedy outputs."""
    from minivllm.entrypoints.llm import LLM

    return LLM(**ENGINE_KWARGS)


@pytest.fixture
def assert_all_blocks_free(engine):
    """A check for the end of a test: the engine drains and every KV block is back in the pool."""

    def check(timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        # Aborts reach the engine between steps, so give the loop a moment to apply them.
        while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.engine.has_unfinished_requests()
        llm_engine = engine.engine
        free = llm_engine.scheduler.block_manager.get_num_free_gpu_blocks()
        assert free == llm_engine.cache_config.num_gpu_blocks

    return check
