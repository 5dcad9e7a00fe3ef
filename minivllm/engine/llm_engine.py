"""The engine: requests in, one model step at a time, `RequestOutput`s out.

Mirrors `vllm/engine/llm_engine.py` (v0, ~0.6). One `step()`:

    1. schedule    the Scheduler picks the batch and the block moves (swap, copy-on-write)
    2. execute     the executor's worker applies the moves, runs the model, samples
    3. process     append the sampled tokens (forking sequences for n > 1 and beam search),
                   detokenize, check stop conditions, free finished sequences' blocks
    4. report      one RequestOutput per request that advanced (all its text so far, or with
                   RequestOutputKind.DELTA the new part), metrics

    engine = LLMEngine.from_engine_args(EngineArgs())          # the bundled model
    engine.add_request("0", "ROMEO:", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.outputs[0].text)

Each optional mode wraps this class in a file of its own, chosen once by `from_engine_args`
(`selector.py`): multi_step.py, async_scheduling.py, spec_decode.py, kv_connector.py;
failure_isolation.py ends only the request a failing step belongs to.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from minivllm.core.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutputs
from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.detokenizer import make_detokenizer
from minivllm.engine.failure_isolation import FailureIsolationMixin
from minivllm.engine.lora_adapters import LoRAAdapters
from minivllm.engine.metrics import StatLoggerBase, Stats
from minivllm.engine.output_processor import SequenceGroupOutputProcessor, StopChecker
from minivllm.executor import get_executor_class
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.executor_base import ExecutorBase
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.plugins import load_general_plugins
from minivllm.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams
from minivllm.sequence import (ExecuteModelRequest, SamplerOutput, Sequence, SequenceGroup,
                               SequenceGroupMetadata, SequenceGroupOutput, SequenceStatus)

logger = logging.getLogger(__name__)

# A folder for `start_profile`'s traces (vLLM: VLLM_TORCH_PROFILER_DIR).
TORCH_PROFILER_DIR_ENV = "MINIVLLM_TORCH_PROFILER_DIR"

PromptInput = str | dict[str, Any]


class StepObserver:
    """Watches the engine from outside, one step at a time (course tooling, tracing).

    Subclass it, override what you need and `engine.add_step_observer(observer)`. The engine
    keeps no state for its observers: they read it through public queries (the scheduler's
    queues, the block manager's tables) at these two moments.
    """

    def on_scheduled(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs) -> None:
        """After `schedule()`, before the model runs: the batch and the blocks as decided."""

    def on_step_end(self, engine: LLMEngine, scheduler_outputs: SchedulerOutputs,
                    request_outputs: list[RequestOutput]) -> None:
        """After the step's outputs are processed and finished requests' blocks freed."""


class LLMEngine(FailureIsolationMixin):
    """Serves requests over one executor (see the module docstring for a step's anatomy).

    Build it with `LLMEngine.from_engine_args(EngineArgs(...))`, which picks the subclass of
    the configured mode (`LLMEngine(engine_config)` refuses a mode's configuration). Attributes:
    `model_config`, `cache_config` (its `num_gpu_blocks` is the pool size after profiling),
    `scheduler_config`, `scheduler` (and `scheduler.block_manager`), `step_observers`
    (`add_step_observer`: course tooling such as `minivllm.viz`'s snapshot recorder watches
    the engine through them).
    """

    def __init__(self, engine_config: EngineConfig, executor_class: type[ExecutorBase] | None = None) -> None:
        load_general_plugins()  # `minivllm.general_plugins` entry points, once per process
        _check_engine_class(self, engine_config)
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.device_config = engine_config.device_config
        # skip_tokenizer_init (vLLM's): no tokenizer; prompts are token ids, outputs have no text.
        self.tokenizer = None if self.model_config.skip_tokenizer_init else _load_tokenizer(self.model_config.tokenizer)
        self.detokenizer = make_detokenizer(self.tokenizer)
        self.eos_token_id = _eos_token_id(self.tokenizer, self.model_config.hf_config)
        self.vocab_size = self.model_config.hf_config.vocab_size
        self.seq_counter = itertools.count()
        # None: the one `distributed_executor_backend` names (uni, mp or ray).
        self.model_executor = (executor_class or get_executor_class(engine_config))(engine_config)
        self._initialize_kv_caches()
        self.scheduler = self._make_scheduler()
        self._loras = LoRAAdapters(engine_config.lora_config, self.model_config.hf_config)
        self.output_processor = SequenceGroupOutputProcessor(
            self.scheduler,
            self.detokenizer,
            StopChecker(self.scheduler_config.max_model_len, self.eos_token_id),
            self.seq_counter,
        )
        self.stat_loggers: dict[str, StatLoggerBase] = {}
        self.step_observers: list[StepObserver] = []
        self.step_counter = 0
        # Requests finished or aborted since the last step: workers drop their state.
        self._finished_requests_ids: list[str] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        """The engine of the configured mode: this class or the mode's subclass (`selector.py`)."""
        from minivllm.engine.selector import engine_class  # deferred: the modes' files import this one

        engine_config = engine_args.create_engine_config()
        return engine_class(engine_config)(engine_config)

    def _make_scheduler(self) -> Scheduler:
        return Scheduler(self.scheduler_config, self.cache_config, self.engine_config.lora_config)

    def _initialize_kv_caches(self) -> None:
        """Profile, then size both pools; the engine's cache config records the counts (a new
        config: the one the executor holds is never changed behind its back)."""
        num_gpu_blocks, num_cpu_blocks = self.model_executor.determine_num_available_blocks()
        self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.cache_config = dataclasses.replace(self.cache_config, num_gpu_blocks=num_gpu_blocks,
                                                num_cpu_blocks=num_cpu_blocks)
        self.engine_config = dataclasses.replace(self.engine_config, cache_config=self.cache_config)
        # `num_gpu_blocks` is vLLM's name for the device's pool, which may be the CPU's memory.
        logger.info("KV cache: %d %s blocks, %d CPU swap blocks of %d tokens", num_gpu_blocks,
                    self.device_config.device_type.upper(), num_cpu_blocks, self.cache_config.block_size)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, Ray actors); a no-op for one in-process worker."""
        executor = getattr(self, "model_executor", None)
        if executor is not None:
            executor.shutdown()
            self.model_executor = None

    def __del__(self) -> None:
        self.shutdown()

    # ================================================================== requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (with `lora_request`: through that adapter, checked by `add_lora`). `prompt` is text or `{"prompt_token_ids": [...]}` (optionally with
        "prompt"). Raises ValueError (an `InvalidParameterError` naming the field where there is
        one) for an empty prompt, unknown token ids, sampling values the model cannot honour
        (see `_finalize_params`), a duplicate id, or a priority without the priority policy;
        nothing is queued then. A prompt longer than `max_model_len` is accepted and finishes
        at the next step with finish_reason "abort" and a `finish_message` saying why.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}.")
        if any(g.request_id == request_id for g in self._unfinished_groups()):
            raise ValueError(f"request id {request_id!r} is already running.")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidParameterError("priority", f"priority must be an integer, got {priority!r}.")
        if priority != 0 and self.scheduler_config.policy != "priority":
            raise InvalidParameterError("priority", f"priority={priority} needs scheduling_policy='priority'.")
        prompt_text, prompt_token_ids = self._process_prompt(prompt)
        params = self._finalize_params(params, len(prompt_token_ids))
        self._loras.use(lora_request)
        seqs = [Sequence(next(self.seq_counter), prompt_text, prompt_token_ids,
                         self.cache_config.block_size, self.eos_token_id, lora_request)]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        seq_group = SequenceGroup(request_id, seqs, arrival_time, params, lora_request=lora_request,
                                  priority=priority)
        self.scheduler.add_seq_group(seq_group)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the base model (ValueError naming the problem) and remember
        it; False if this id was already added. The workers read its weights when a batch
        first needs it (`LoRAAdapters.add`)."""
        return self._loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already queued with it still finish); False if unknown."""
        return self._loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return self._loras.ids()

    def _process_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise InvalidParameterError("prompt", "skip_tokenizer_init is set: give {'prompt_token_ids': [...]}, not text.")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if text is not None and not isinstance(text, str):
                raise InvalidParameterError("prompt", f"the prompt's text must be a string, got {text!r}.")
            if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
                raise InvalidParameterError("prompt_token_ids", f"prompt_token_ids must be a list, got {token_ids!r}.")
            token_ids = list(token_ids)
        else:
            raise InvalidParameterError(
                "prompt", f"prompt must be a string or a dict with 'prompt_token_ids', got {prompt!r:.200}.")
        if not token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty: give at least one token.")
        self._check_token_ids("prompt", token_ids)
        return text, [int(t) for t in token_ids]

    def _check_token_ids(self, name: str, token_ids: Iterable[object]) -> None:
        """Every id must index the embedding table (and the logits): else a step would fail."""
        bad = [t for t in token_ids
               if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError(name, f"{name} must be token ids, integers in [0, {self.vocab_size}), got {bad[:5]}.")

    def _finalize_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A private copy checked against this model, with the model's EOS among the stop ids.

        `SamplingParams` checks what needs no model; here, what does: token ids and logprob
        counts within the vocabulary, and `min_tokens` within the context (the stop checker
        keeps a sequence going until min_tokens, past max_model_len if allowed to).
        """
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise InvalidParameterError(name, f"{name} must be at most the vocabulary size {self.vocab_size}, got {value}.")
        max_model_len = self.scheduler_config.max_model_len
        if params.min_tokens and num_prompt_tokens + params.min_tokens > max_model_len:
            raise InvalidParameterError(
                "min_tokens", f"min_tokens={params.min_tokens} does not fit after the {num_prompt_tokens}-token prompt "
                f"in max_model_len={max_model_len}.")
        params = params.clone()
        if self.tokenizer is None:  # skip_tokenizer_init: token ids out, no text to stop on
            if params.stop:
                raise InvalidParameterError("stop", "stop strings need a tokenizer (skip_tokenizer_init is set).")
            params.detokenize = False
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            params.all_stop_token_ids.add(self.eos_token_id)
        if params.max_tokens is None:
            params.max_tokens = max_model_len
        return params

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests wherever they are (waiting, running, swapped) and free their blocks.

        As in vLLM, an id that is not running (never added, or already finished) is not an
        error: aborting races with finishing in any server. It is logged as a warning.
        """
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        live = {g.request_id for g in self._unfinished_groups()}
        for unknown in [r for r in request_ids if r not in live]:
            logger.warning("abort_request: no unfinished request %r (never added or already finished)", unknown)
        known = [r for r in request_ids if r in live]
        self.scheduler.abort_seq_group(known)
        self._finished_requests_ids.extend(known)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def start_profile(self) -> None:
        """torch.profiler on every worker until `stop_profile`; the traces go to the folder
        named by MINIVLLM_TORCH_PROFILER_DIR (vLLM: VLLM_TORCH_PROFILER_DIR), read here, in
        the engine's process."""
        trace_dir = os.environ.get(TORCH_PROFILER_DIR_ENV)
        if not trace_dir:
            raise RuntimeError(f"profiling is off: set {TORCH_PROFILER_DIR_ENV} to a folder for the traces.")
        self.model_executor.start_profile(trace_dir)

    def stop_profile(self) -> list[str]:
        """Every worker's Chrome trace of the steps since `start_profile`: the paths, by rank."""
        return self.model_executor.stop_profile()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def _unfinished_groups(self) -> Iterable[SequenceGroup]:
        return itertools.chain(self.scheduler.waiting, self.scheduler.running, self.scheduler.swapped)

    # ================================================================== a step
    def step(self, on_model_step: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One engine step: schedule -> execute -> process -> report.

        Returns the outputs of the requests it advanced or finished.
        on_model_step: called with partial outputs between the model steps of a multi-step
            run (`MultiStepLLMEngine`); a plain step runs one model step and never calls it.
        """
        scheduler_outputs, request = self._schedule()
        for observer in self.step_observers:
            observer.on_scheduled(self, scheduler_outputs)
        stats = self._new_stats(time.monotonic(), scheduler_outputs)
        if request is not None:
            self._execute_and_process(request, scheduler_outputs.scheduled_seq_groups, stats)
        now = stats.now = time.monotonic()
        request_outputs = self._report(scheduler_outputs, now, stats)
        self.scheduler.free_finished_seq_groups()
        self._fill_system_stats(stats)
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats)
        for observer in self.step_observers:
            observer.on_step_end(self, scheduler_outputs, request_outputs)
        self.step_counter += 1
        return request_outputs

    def _schedule(self) -> tuple[SchedulerOutputs, ExecuteModelRequest | None]:
        """The scheduler's decision, and the request that runs it (None: nothing to run)."""
        seq_group_metadata_list, scheduler_outputs, _ = self.scheduler.schedule()
        if scheduler_outputs.is_empty():
            return scheduler_outputs, None
        return scheduler_outputs, self._execute_model_request(seq_group_metadata_list, scheduler_outputs)

    def _execute_model_request(self, seq_group_metadata_list: list[SequenceGroupMetadata],
                               scheduler_outputs: SchedulerOutputs) -> ExecuteModelRequest:
        request = ExecuteModelRequest(
            seq_group_metadata_list=seq_group_metadata_list,
            blocks_to_swap_in=scheduler_outputs.blocks_to_swap_in,
            blocks_to_swap_out=scheduler_outputs.blocks_to_swap_out,
            blocks_to_copy=scheduler_outputs.blocks_to_copy,
            finished_requests_ids=self._finished_requests_ids,
            # Steps the worker may run: more than one when every decode reserved lookahead slots.
            num_steps=1 + max((m.num_lookahead_slots for m in seq_group_metadata_list), default=0),
            kv_connector_metadata=scheduler_outputs.kv_connector_metadata,
        )
        self._finished_requests_ids = []
        return request

    def _execute_and_process(self, request: ExecuteModelRequest, scheduled_groups: list[ScheduledSequenceGroup],
                             stats: Stats) -> None:
        """Run the model and apply its samples, one `SamplerOutput` per model step in order (a
        single-step run hands back one). If the run raises, `_recover_from_failed_run`
        (failure_isolation.py) ends only the request it belongs to."""
        num_processed = 0
        try:
            for sampler_output in self._execute(request):
                self._process_model_outputs(sampler_output, scheduled_groups, stats, is_first_step=num_processed == 0)
                num_processed += 1
        except WorkerDiedError:  # the engine's failure, not a request's: no retry can help
            raise
        except Exception as error:
            self._recover_from_failed_run(request, scheduled_groups, stats, error, num_processed)

    def _execute(self, request: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        return self.model_executor.execute_model(request)

    def _process_model_outputs(self, sampler_output: SamplerOutput, scheduled_groups: list[ScheduledSequenceGroup],
                               stats: Stats, is_first_step: bool) -> None:
        """Apply one model step's samples to the scheduled groups, in batch order.

        The first step computed each group's scheduled chunk (a prompt chunk, or the one
        token of a decode); a later step of a multi-step run computed exactly the token fed
        to it (the one sampled a step earlier). A group that stopped in an earlier step of
        the run ignores the rest: those tokens were computed past its end, and a group out of
        reserved slots gets no samples.
        """
        now = time.monotonic()
        for scheduled, output in zip(scheduled_groups, sampler_output):
            seq_group = scheduled.seq_group
            if seq_group.is_finished() or not (is_first_step or output.samples):
                continue
            try:
                self._process_group_output(scheduled, output, stats, is_first_step, now)
            except Exception as error:  # this request's own output failed: it alone ends
                self._fail_requests([seq_group], error)

    def _process_group_output(self, scheduled: ScheduledSequenceGroup, output: SequenceGroupOutput,
                              stats: Stats, is_first_step: bool, now: float) -> None:
        seq_group = scheduled.seq_group
        first_computed = seq_group.get_unfinished_seqs()[0].get_num_computed_tokens()
        num_computed = scheduled.token_chunk_size if is_first_step else 1
        if is_first_step and seq_group.is_prefill():
            stats.num_prompt_tokens_iter += num_computed
        # The step computed these tokens' K/V; the tokens sampled below are not yet in the cache.
        seq_group.update_num_computed_tokens(num_computed)
        if output.prompt_logprobs:
            self._record_prompt_logprobs(seq_group, output, first_computed)
        if output.samples:
            self._update_metrics(seq_group, now, stats)
            self.output_processor.process_outputs(seq_group, output.samples)
            # Beam search proposes 2 x beam_width candidates but keeps beam_width.
            stats.num_generation_tokens_iter += min(len(output.samples), seq_group.sampling_params.best_of)

    def _report(self, scheduler_outputs: SchedulerOutputs, now: float, stats: Stats) -> list[RequestOutput]:
        """One output per scheduled or ignored request (unfinished FINAL_ONLY ones excepted)."""
        reported = [s.seq_group for s in scheduler_outputs.scheduled_seq_groups]
        for seq_group in scheduler_outputs.ignored_seq_groups:
            if seq_group.finish_message:
                logger.warning("request %s: %s", seq_group.request_id, seq_group.finish_message)
            reported.append(seq_group)
        request_outputs = [self._make_request_output(seq_group, now, stats) for seq_group in reported]
        return [output for output in request_outputs if output is not None]

    # ------------------------------------------------------------------ observers
    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer` around every step (pictures, traces: see `StepObserver`)."""
        self.step_observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.step_observers.remove(observer)

    def _record_prompt_logprobs(self, seq_group: SequenceGroup, output: SequenceGroupOutput, first_computed: int) -> None:
        """Store per-position prompt logprobs once (a recompute after preemption repeats them)."""
        if seq_group.prompt_logprobs is None:
            seq_group.prompt_logprobs, seq_group.prompt_ranks = [None], [None]
        ranks = output.prompt_ranks or [None] * len(output.prompt_logprobs)
        for offset, (entry, rank) in enumerate(zip(output.prompt_logprobs, ranks)):
            position = first_computed + 1 + offset  # row t predicts prompt token t + 1
            # Positions skipped by a prefix-cache hit have no logits: None, as for token 0.
            while len(seq_group.prompt_logprobs) < position:
                seq_group.prompt_logprobs.append(None)
                seq_group.prompt_ranks.append(None)
            if len(seq_group.prompt_logprobs) == position:
                seq_group.prompt_logprobs.append(entry)
                seq_group.prompt_ranks.append(rank)

    # ------------------------------------------------------------------ outputs
    def _make_request_output(self, seq_group: SequenceGroup, now: float, stats: Stats) -> RequestOutput | None:
        """The request's output now; None for an unfinished FINAL_ONLY request."""
        if seq_group.is_finished():
            self._on_request_finished(seq_group, now, stats)
        elif seq_group.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        return RequestOutput.from_seq_group(seq_group, None if self.tokenizer is None else self.detokenizer.decode_token, self.eos_token_id)

    # ------------------------------------------------------------------ metrics
    def add_logger(self, logger_name: str, stat_logger: StatLoggerBase) -> None:
        if logger_name in self.stat_loggers:
            raise KeyError(f"a logger named {logger_name!r} already exists.")
        self.stat_loggers[logger_name] = stat_logger

    def remove_logger(self, logger_name: str) -> None:
        if logger_name not in self.stat_loggers:
            raise KeyError(f"no logger named {logger_name!r}.")
        del self.stat_loggers[logger_name]

    def _new_stats(self, now: float, scheduler_outputs: SchedulerOutputs) -> Stats:
        return Stats(now=now, num_running_sys=0, num_waiting_sys=0, num_swapped_sys=0,
                     gpu_cache_usage_sys=0.0, cpu_cache_usage_sys=0.0, gpu_prefix_cache_hit_rate=0.0,
                     num_preemption_iter=scheduler_outputs.preempted)

    def _fill_system_stats(self, stats: Stats) -> None:
        block_manager = self.scheduler.block_manager
        num_gpu, num_cpu = self.cache_config.num_gpu_blocks, self.cache_config.num_cpu_blocks
        stats.num_running_sys = len(self.scheduler.running)
        stats.num_waiting_sys = len(self.scheduler.waiting)
        stats.num_swapped_sys = len(self.scheduler.swapped)
        stats.gpu_cache_usage_sys = 1.0 - block_manager.get_num_free_gpu_blocks() / num_gpu
        stats.cpu_cache_usage_sys = 1.0 - block_manager.get_num_free_cpu_blocks() / num_cpu if num_cpu else 0.0
        stats.gpu_prefix_cache_hit_rate = self.scheduler.get_prefix_cache_hit_rate()

    @staticmethod
    def _update_metrics(seq_group: SequenceGroup, now: float, stats: Stats) -> None:
        metrics = seq_group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            stats.time_to_first_tokens_iter.append(now - metrics.arrival_time)
        else:
            stats.time_per_output_tokens_iter.append(now - metrics.last_token_time)
        metrics.last_token_time = now

    def _on_request_finished(self, seq_group: SequenceGroup, now: float, stats: Stats) -> None:
        metrics = seq_group.metrics
        if metrics.finished_time is not None:
            return
        metrics.finished_time = now
        self._finished_requests_ids.append(seq_group.request_id)
        stats.time_e2e_requests.append(now - metrics.arrival_time)
        if metrics.time_in_queue is not None:
            stats.time_in_queue_requests.append(metrics.time_in_queue)
        stats.num_prompt_tokens_requests.append(len(seq_group.prompt_token_ids))
        stats.num_generation_tokens_requests.append(sum(s.get_output_len() for s in seq_group.get_seqs()))
        reasons = [SequenceStatus.get_finished_reason(s.status) for s in seq_group.get_seqs()]
        stats.finished_reason_requests.append(reasons[0] or "")


def _check_engine_class(engine: LLMEngine, engine_config: EngineConfig) -> None:
    """The workers follow the configuration's modes: an engine class without them would drop
    their outputs' meaning (a KV connector never consulted, speculative metrics lost)."""
    from minivllm.engine.selector import engine_class  # deferred: the modes' files import this one

    needed = engine_class(engine_config)
    if not isinstance(engine, needed):
        raise ValueError(f"this configuration needs {needed.__name__}, not {type(engine).__name__}: "
                         "build the engine with LLMEngine.from_engine_args.")


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    return AutoTokenizer.from_pretrained(name)


def _eos_token_id(tokenizer, hf_config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) and eos else eos
