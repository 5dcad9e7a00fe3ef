"""Pipeline parallelism with the pipeline kept busy: `pp` virtual engines, each a plain
`LLMEngine` stepping in its own thread (vLLM v0 runs them as concurrent `engine_step`
coroutines of its `AsyncLLMEngine`, one per `virtual_engine`).

    engine = PipelineParallelEngine.from_engine_args(EngineArgs(model=..., pipeline_parallel_size=2))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)      # to the least busy virtual engine
    outputs = engine.run()                              # every request's final RequestOutput

Each virtual engine has its own scheduler, its own requests and 1/pp of the KV blocks (its
own caches on every worker), so its next batch never waits for another's tokens: while
stage 1 runs virtual engine 0's batch, stage 0 runs virtual engine 1's. All share one `mp`
executor (`minivllm/executor/virtual_engine.py`). The plain `LLMEngine` with
`pipeline_parallel_size > 1` runs one batch at a time instead.

Differs from vLLM: offline only (`run()` steps every virtual engine until its requests are
done; no streaming API), `mp` executor only.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterable

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptInput
from minivllm.executor.virtual_engine import SharedPipeline, VirtualEngineExecutor
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class PipelineParallelEngine:
    """`pipeline_parallel_size` virtual engines over one `mp` executor."""

    def __init__(self, engine_config: EngineConfig) -> None:
        parallel = engine_config.parallel_config
        if parallel.pipeline_parallel_size < 2 or parallel.distributed_executor_backend != "mp":
            raise ValueError("PipelineParallelEngine needs pipeline_parallel_size >= 2 and the 'mp' executor, got "
                             f"{parallel.pipeline_parallel_size} and {parallel.distributed_executor_backend!r}.")
        self.shared = SharedPipeline(engine_config)
        try:
            self.engines = [LLMEngine(engine_config, executor_class=functools.partial(VirtualEngineExecutor,
                                                                                    self.shared, v))
                            for v in range(parallel.pipeline_parallel_size)]
        except BaseException:
            self.shared.shutdown()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "PipelineParallelEngine":
        return cls(engine_args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None) -> None:
        """Queue on the virtual engine with the fewest unfinished requests (the id must be
        unique across them: abort reaches every virtual engine)."""
        # `run` keeps finished outputs only, as `LLM.generate` does: ask for nothing else (a
        # DELTA request's finished output would be only its last piece).
        params = dataclasses.replace(params or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
        min(self.engines, key=LLMEngine.get_num_unfinished_requests).add_request(request_id, prompt, params)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for engine in self.engines:
            engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    def run(self) -> list[RequestOutput]:
        """Step every virtual engine, each in its own thread, until all requests finish; the
        finished outputs (in the order they finished). The first error of any raises here."""
        finished: list[RequestOutput] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def loop(engine: LLMEngine) -> None:
            try:
                while engine.has_unfinished_requests() and not errors:
                    done = [output for output in engine.step() if output.finished]
                    with lock:
                        finished.extend(done)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=loop, args=(engine,), name=f"virtual-engine-{v}")
                   for v, engine in enumerate(self.engines)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return finished

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        self.shared.shutdown()
