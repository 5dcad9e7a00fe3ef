"""The engine: requests in, one model step at a time, `RequestOutput`s out.

Mirrors `vllm/engine/llm_engine.py` (v0). One `step()`: schedule (the batch and its block
moves) -> execute (the worker moves blocks, runs the model, samples) -> process (append, fork,
detokenize, stop, free) -> report (one `RequestOutput` per request that advanced).

    engine = LLMEngine.from_engine_args(EngineArgs())          # the bundled model
    engine.add_request("0", "ROMEO:", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.outputs[0].text)

A mode's engine subclasses this one in a file of its own (`selector.py`). The mixins' files
hold vLLM's optional calls (stat loggers, LoRA adapters, profiling) and minivllm's step
observers; `FailureIsolationMixin` ends only the request a failing step belongs to.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from minivllm.core.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutputs
from minivllm.config import EngineConfig, resolve_obj_by_qualname
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.detokenizer import make_detokenizer
from minivllm.engine.failure_isolation import FailureIsolationMixin
from minivllm.engine.input_preprocess import PromptInput, check_token_ids, process_prompt
from minivllm.engine.lora_adapters import LoRAAdapters, LoRAEngineMixin
from minivllm.engine.metrics import EngineStatsMixin, StatLoggerBase, Stats
from minivllm.engine.output_processor import SequenceGroupOutputProcessor, StopChecker
from minivllm.engine.profiler import EngineProfilerMixin
from minivllm.engine.prompt_logprobs import record_prompt_logprobs
from minivllm.engine.startup_log import StartupTimer
from minivllm.engine.step_observer import StepObserver, StepObserverMixin
from minivllm.executor import get_executor_class
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.executor_base import ExecutorBase
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.plugins import load_general_plugins
from minivllm.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams
from minivllm.sequence import (ExecuteModelRequest, SamplerOutput, Sequence, SequenceGroup,
                               SequenceGroupMetadata, SequenceGroupOutput)

logger = logging.getLogger(__name__)


class LLMEngine(EngineStatsMixin, LoRAEngineMixin, EngineProfilerMixin, StepObserverMixin,
                FailureIsolationMixin):
    """Serves requests over one executor; build it with `LLMEngine.from_engine_args`.

    `cache_config.num_gpu_blocks` is the pool size after profiling; `scheduler.block_manager`
    holds the block tables. `LLMEngine(engine_config)` refuses a mode's configuration.
    """

    mode_scheduler: type[Scheduler] = Scheduler  # the scheduler class this engine's mode needs

    def __init__(self, engine_config: EngineConfig, executor_class: type[ExecutorBase] | None = None) -> None:
        startup = StartupTimer()  # where start-up time goes: one INFO line at the end
        load_general_plugins()  # `minivllm.general_plugins` entry points, once per process
        _check_engine_class(self, engine_config)
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.device_config = engine_config.device_config
        # skip_tokenizer_init (vLLM's): no tokenizer; prompts are token ids, outputs have no text.
        self.tokenizer = None if self.model_config.skip_tokenizer_init else self.model_config.load_tokenizer()
        self.detokenizer = make_detokenizer(self.tokenizer)
        self.eos_token_id = _eos_token_id(self.tokenizer, self.model_config.hf_config)
        self.vocab_size = self.model_config.hf_config.vocab_size
        self.seq_counter = itertools.count()
        startup.lap("tokenizer")
        # None: the one `distributed_executor_backend` names (uni, mp or ray).
        self.model_executor = (executor_class or get_executor_class(engine_config))(engine_config)
        startup.lap("workers and weights")
        self._initialize_kv_caches(startup)
        self.scheduler = self._make_scheduler()
        self._loras = LoRAAdapters(engine_config.lora_config, self.model_config.hf_config)
        stop_checker = StopChecker(self.scheduler_config.max_model_len, self.eos_token_id)
        self.output_processor = SequenceGroupOutputProcessor(
            self.scheduler, self.detokenizer, stop_checker, self.seq_counter)
        self.stat_loggers: dict[str, StatLoggerBase] = {}
        self.step_observers: list[StepObserver] = []
        self.step_counter = 0
        # Requests finished or aborted since the last step: workers drop their state.
        self._finished_requests_ids: list[str] = []
        startup.log(logger)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        """The engine of the configured mode: this class or the mode's subclass (`selector.py`)."""
        from minivllm.engine.selector import engine_class  # deferred: the modes' files import this one

        engine_config = engine_args.create_engine_config()
        return engine_class(engine_config)(engine_config)

    def _make_scheduler(self) -> Scheduler:
        return self._scheduler_class()(self.scheduler_config, self.cache_config, self.engine_config.lora_config)

    def _scheduler_class(self) -> type[Scheduler]:
        """`scheduler_cls` (vLLM's extension point): `mode_scheduler` or a subclass of it."""
        cls = resolve_obj_by_qualname(self.scheduler_config.scheduler_cls)
        if cls is Scheduler:
            return self.mode_scheduler
        if not (isinstance(cls, type) and issubclass(cls, self.mode_scheduler)):
            raise ValueError(f"scheduler_cls must be a subclass of {self.mode_scheduler.__name__}, got {cls!r}.")
        return cls

    def _initialize_kv_caches(self, startup: StartupTimer) -> None:
        """Profile, then size both pools, recorded in a new cache config (the executor's stays)."""
        num_gpu_blocks, num_cpu_blocks = self.model_executor.determine_num_available_blocks()
        startup.lap("profile run")
        self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        startup.lap("KV cache and graphs")
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
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. `prompt` is text or `{"prompt_token_ids": [...]}` (optionally with
        "prompt"); `lora_request` is checked as by `add_lora`. Bad input raises ValueError (an
        `InvalidParameterError` naming the field) and queues nothing. A prompt longer than
        `max_model_len` finishes at the next step with finish_reason "abort" and a `finish_message`.
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
        prompt_text, prompt_token_ids = process_prompt(prompt, self.tokenizer, self.vocab_size)
        params = self._finalize_params(params, len(prompt_token_ids))
        self._loras.use(lora_request)
        seqs = [Sequence(next(self.seq_counter), prompt_text, prompt_token_ids,
                         self.cache_config.block_size, self.eos_token_id, lora_request)]
        seq_group = SequenceGroup(request_id, seqs, arrival_time, params, lora_request=lora_request,
                                  priority=priority)
        self.scheduler.add_seq_group(seq_group)

    def _finalize_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A private copy checked against this model (`SamplingParams` checks what needs no
        model): token ids and logprob counts within the vocabulary, `min_tokens` within the
        context; the model's EOS joins the stop ids."""
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
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
        An unknown or finished id is only a warning (as in vLLM: aborts race with finishing)."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        live = {g.request_id for g in self._unfinished_groups()}
        for unknown in [r for r in request_ids if r not in live]:
            logger.warning("abort_request: no unfinished request %r (never added or already finished)", unknown)
        known = [r for r in request_ids if r in live]
        self.scheduler.abort_seq_group(known)
        self._finished_requests_ids.extend(known)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def _unfinished_groups(self) -> Iterable[SequenceGroup]:
        return itertools.chain(self.scheduler.waiting, self.scheduler.running, self.scheduler.swapped)

    # ================================================================== a step
    def step(self, on_model_step: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Schedule -> execute -> process -> report: the outputs of the requests it advanced.
        `on_model_step` is `MultiStepLLMEngine`'s (partial outputs between model steps)."""
        scheduler_outputs, request = self._schedule()
        for observer in self.step_observers:
            observer.on_scheduled(self, scheduler_outputs)
        stats = self._new_stats(time.monotonic(), scheduler_outputs)
        if request is not None:
            self._execute_and_process(request, scheduler_outputs.scheduled_seq_groups, stats)
        now = stats.now = time.monotonic()
        request_outputs = self._report(scheduler_outputs, now, stats)
        self.scheduler.free_finished_seq_groups()
        self._log_stats(stats)
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
        """Run the model and apply each model step's `SamplerOutput` in order (one for a plain
        step). If the run raises, `_recover_from_failed_run` ends only its culprit."""
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
        """Apply one model step's samples to the scheduled groups, in batch order. The first
        step computed each group's scheduled chunk, a later one (multi-step) one token; a group
        finished earlier in the run, or without samples in a later step, is skipped."""
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
        num_computed = scheduled.token_chunk_size if is_first_step else 1
        if is_first_step and seq_group.is_prefill():
            stats.num_prompt_tokens_iter += num_computed
        if output.prompt_logprobs:
            first_computed = seq_group.get_unfinished_seqs()[0].get_num_computed_tokens()
            record_prompt_logprobs(seq_group, output, first_computed)
        # The step computed these tokens' K/V; the tokens sampled below are not yet in the cache.
        seq_group.update_num_computed_tokens(num_computed)
        if output.samples:
            self._record_token_times(seq_group, now, stats)
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

    def _make_request_output(self, seq_group: SequenceGroup, now: float, stats: Stats) -> RequestOutput | None:
        """The request's output now; None for an unfinished FINAL_ONLY request."""
        if not seq_group.is_finished():
            if seq_group.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                return None
        elif seq_group.metrics.finished_time is None:  # first reported finished: record it once
            seq_group.metrics.finished_time = now
            self._finished_requests_ids.append(seq_group.request_id)
            self._record_finished_request(seq_group, now, stats)
        decode_token = None if self.tokenizer is None else self.detokenizer.decode_token
        return RequestOutput.from_seq_group(seq_group, decode_token, self.eos_token_id)


def _check_engine_class(engine: LLMEngine, engine_config: EngineConfig) -> None:
    """The workers follow the configuration's modes: an engine class without them would drop
    their outputs' meaning (a KV connector never consulted, speculative metrics lost)."""
    from minivllm.engine.selector import engine_class  # deferred: the modes' files import this one

    needed = engine_class(engine_config)
    if not isinstance(engine, needed):
        raise ValueError(f"this configuration needs {needed.__name__}, not {type(engine).__name__}: "
                         "build the engine with LLMEngine.from_engine_args.")


def _eos_token_id(tokenizer, hf_config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) and eos else eos
