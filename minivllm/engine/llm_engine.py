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

Parallel sampling and beam search reuse one mechanism, as in the paper: a sequence that
gets several next tokens is *forked* (`Sequence.fork` + `Scheduler.fork_seq`), so the
children share the parent's KV blocks by reference count until they write to them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import numbers
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutputs
from minivllm.config import EngineConfig
from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.detokenizer import make_detokenizer
from minivllm.engine.metrics import StatLoggerBase, Stats
from minivllm.engine.output_processor import SequenceGroupOutputProcessor, StopChecker
from minivllm.executor import get_executor_class
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.executor.executor_base import ExecutorBase
from minivllm.lora.peft_helper import load_peft_helper
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


class LLMEngine:
    """Serves requests over one executor (see the module docstring for a step's anatomy).

    Build it with `LLMEngine.from_engine_args(EngineArgs(...))`. Attributes worth knowing:
    `model_config`, `cache_config` (its `num_gpu_blocks` is the pool size after profiling),
    `scheduler_config`, `scheduler` (and `scheduler.block_manager`), `step_observers`
    (`add_step_observer`: course tooling such as `minivllm.viz`'s snapshot recorder watches
    the engine through them).
    """

    def __init__(self, engine_config: EngineConfig, executor_class: type[ExecutorBase] | None = None) -> None:
        load_general_plugins()  # `minivllm.general_plugins` entry points, once per process
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
        # The scheduler side of a KV connector (each worker builds its own worker side).
        self.kv_connector = None if engine_config.kv_transfer_config is None else \
            KVConnectorFactory.create_connector(engine_config, KVConnectorRole.SCHEDULER)
        self.kv_transfer_stats = None  # the driver worker's connector counts, after each step
        self.scheduler = (AsyncScheduler if self.scheduler_config.async_scheduling else Scheduler)(self.scheduler_config, self.cache_config, engine_config.lora_config,
                                   kv_connector=self.kv_connector)
        self._loras: dict[int, LoRARequest] = {}  # adapters checked by add_lora, by id
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
        # A run scheduled and queued during the last step (async scheduling): its metadata,
        # decision, request and outputs, or None.
        self._scheduled_ahead: tuple | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def _initialize_kv_caches(self) -> None:
        """Profile, then size both pools; the engine's cache config records the counts (a new
        config: the one the executor holds is never changed behind its back)."""
        num_gpu_blocks, num_cpu_blocks = self.model_executor.determine_num_available_blocks()
        self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.cache_config = dataclasses.replace(self.cache_config, num_gpu_blocks=num_gpu_blocks,
                                                num_cpu_blocks=num_cpu_blocks)
        self.engine_config = dataclasses.replace(self.engine_config, cache_config=self.cache_config)
        logger.info("KV cache: %d GPU blocks, %d CPU blocks of %d tokens",
                    num_gpu_blocks, num_cpu_blocks, self.cache_config.block_size)

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
        if lora_request is not None:
            self.add_lora(lora_request)
        seqs = [Sequence(next(self.seq_counter), prompt_text, prompt_token_ids,
                         self.cache_config.block_size, self.eos_token_id, lora_request)]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        seq_group = SequenceGroup(request_id, seqs, arrival_time, params, lora_request=lora_request,
                                  priority=priority)
        self.scheduler.add_seq_group(seq_group)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the base model (ValueError naming the problem: see
        `minivllm.lora.peft_helper`) and remember it; False if this id was already added. The
        workers read its weights when a batch first needs it."""
        lora_config = self.engine_config.lora_config
        if lora_config is None:
            raise ValueError("a lora_request needs an engine with enable_lora=True.")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        known = self._loras.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(f"lora_int_id {known.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"at {known.lora_path!r}: one id per adapter.")
            return False
        load_peft_helper(lora_request.lora_path, self.model_config.hf_config, lora_config.max_lora_rank)
        self._loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already queued with it still finish); False if unknown.
        Its id must not be reused for another adapter: the workers' caches are keyed by it."""
        return self._loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self._loras)

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
        if params.use_beam_search and self.engine_config.speculative_config is not None:
            raise InvalidParameterError("use_beam_search", "beam search cannot be combined with speculative "
                                        "decoding (as in vLLM): start the engine without speculative_model.")
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

        Returns the outputs of the requests it advanced or finished. A multi-step run
        (`num_scheduler_steps` > 1) hands back one `SamplerOutput` per model step, each as
        soon as it reaches the host while the GPU already computes the next: processing it
        here overlaps the GPU. A single-step run hands back one.

        on_model_step: called with the unfinished requests' outputs after each model step of
            a multi-step run but the last (whose outputs this returns), so that a streaming
            client still sees its tokens one at a time (`AsyncLLMEngine` passes it).
        """
        seq_group_metadata_list, scheduler_outputs, request, outputs = self._take_scheduled_ahead()
        if scheduler_outputs is None:
            seq_group_metadata_list, scheduler_outputs, _ = self.scheduler.schedule()
        # A request of a run scheduled ahead may have ended since (its last token, an abort):
        # it was reported then, and its rows in this run are computed past its end.
        ended = {id(s.seq_group) for s in scheduler_outputs.scheduled_seq_groups if s.seq_group.is_finished()}
        for observer in self.step_observers:
            observer.on_scheduled(self, scheduler_outputs)
        stats = self._new_stats(time.monotonic(), scheduler_outputs)
        if not scheduler_outputs.is_empty():
            if request is None:
                request = self._execute_model_request(seq_group_metadata_list, scheduler_outputs)
            self._execute_and_process(request, scheduler_outputs.scheduled_seq_groups, stats, on_model_step, outputs)
        now = stats.now = time.monotonic()
        request_outputs = self._report(scheduler_outputs, now, stats, skip=ended)
        self.scheduler.free_finished_seq_groups()
        self._fill_system_stats(stats)
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats)
        for observer in self.step_observers:
            observer.on_step_end(self, scheduler_outputs, request_outputs)
        self.step_counter += 1
        return request_outputs

    # ------------------------------------------------------------------ async scheduling
    def _schedule_ahead(self, scheduled_groups: list[ScheduledSequenceGroup], num_steps: int) -> None:
        """Schedule the next multi-step run and queue it on the device now, while the current
        run's last step still computes (vLLM's async scheduling; `Scheduler.schedule_ahead`
        says when it can). The GPU then runs it right after that step instead of waiting
        for the host to process the step, schedule and prepare the next batch; the next
        `step()` only processes it. The price: a request that stops on its last token of
        this run (EOS, a stop string) computes one run past its end, thrown away.
        """
        self.scheduler.free_finished_seq_groups()  # requests that stopped earlier in this run
        in_flight = {s.seq_group.request_id for s in scheduled_groups
                     if s.num_lookahead_slots == num_steps - 1 and not s.seq_group.is_finished()}
        scheduled = self.scheduler.schedule_ahead(in_flight)
        if scheduled is None:
            return
        metadata, scheduler_outputs = scheduled
        request = dataclasses.replace(self._execute_model_request(metadata, scheduler_outputs),
                                      continues_previous_run=True)
        try:
            outputs = self.model_executor.execute_model(request)
        except WorkerDiedError:
            raise
        except Exception as error:  # run it the usual way next step, from the host's tokens
            if self.engine_config.parallel_config.world_size > 1:
                # The other ranks may have queued it already: their collectives would pair
                # with the retry's. Nothing safe is left to do.
                raise WorkerDiedError(f"queueing the run scheduled ahead failed on the driver ({error!r}); "
                                      "the other ranks may have queued it: the engine cannot continue.") from error
            logger.warning("could not queue the run scheduled ahead (%r); it runs after this one", error)
            request, outputs = dataclasses.replace(request, continues_previous_run=False), None
        self._scheduled_ahead = (metadata, scheduler_outputs, request, outputs)

    def _drop_run_continuing_lost_tokens(self) -> None:
        """A step that failed after a run was queued ahead may not have appended the tokens
        that run continues from: drop the run (its device work is thrown away; the next
        schedule starts again from the host's tokens, whose K/V the failed run wrote)."""
        ahead = self._scheduled_ahead
        if ahead is None or not ahead[2].continues_previous_run:
            return  # nothing queued, or a plain request: it runs from the host's tokens
        self._scheduled_ahead = None
        with contextlib.suppress(Exception):  # its own failure changes nothing: it is dropped anyway
            for _ in ahead[3] or ():
                pass

    def _take_scheduled_ahead(self) -> tuple:
        """(metadata, decision, request, outputs) of the run scheduled ahead, or Nones. A run
        none of whose requests is still unfinished is drained and dropped."""
        ahead, self._scheduled_ahead = self._scheduled_ahead, None
        if ahead is None:
            return None, None, None, None
        if all(s.seq_group.is_finished() for s in ahead[1].scheduled_seq_groups):
            if ahead[3] is None:  # never reached the worker: its finished ids still must
                self._finished_requests_ids.extend(ahead[2].finished_requests_ids)
            for _ in ahead[3] or ():  # its device work, computed past every request's end
                pass
            return None, None, None, None
        return ahead

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

    # ------------------------------------------------------------------ failures
    def _execute_and_process(self, request: ExecuteModelRequest, scheduled_groups: list[ScheduledSequenceGroup],
                             stats: Stats, on_model_step: Callable[[list[RequestOutput]], None] | None = None,
                             outputs: Iterable[SamplerOutput] | None = None) -> None:
        """Run the model and apply its samples; if the model raises, only its culprit ends.

        Validation at `add_request` makes this rare; when it happens, the engine stays usable:
        * The model raised before any sample came back: the batch is as it was before the
          step (no token appended, no computed count advanced; K/V the run wrote is written
          again), so each group runs again ALONE (`_execute_alone`) and only a group that
          fails alone is finished, by `_fail_requests`. One extra model run per group, and
          only after a failure: the simplest isolation that never fails an innocent request.
        * A later step of a multi-step run raised: what came back stands; the next step goes
          on from there (and isolates the culprit if the failure comes again).

        outputs: the run's outputs when it was queued already (scheduled ahead). With async
        scheduling the next run is scheduled and queued before the last output is processed.
        """
        num_processed = 0
        try:
            if outputs is None:
                outputs = self.model_executor.execute_model(request)
            for sampler_output in outputs:
                if num_processed and on_model_step is not None:  # another model step came: report the last
                    on_model_step(self._partial_outputs(scheduled_groups))
                if sampler_output.spec_decode_worker_metrics is not None:
                    stats.spec_decode_metrics = sampler_output.spec_decode_worker_metrics
                if sampler_output.kv_transfer_stats is not None:
                    stats.kv_transfer_stats = self.kv_transfer_stats = sampler_output.kv_transfer_stats
                self._process_model_outputs(sampler_output, scheduled_groups, stats, is_first_step=num_processed == 0)
                num_processed += 1
                if sampler_output.steps_left == 1 and self.scheduler_config.async_scheduling:
                    self._schedule_ahead(scheduled_groups, request.num_steps)
        except WorkerDiedError:  # the engine's failure, not a request's: no retry can help
            raise
        except Exception as error:
            self._drop_run_continuing_lost_tokens()
            if num_processed:
                logger.warning("step %d failed after %d model steps; the rest runs next step: %r",
                               self.step_counter, num_processed, error)
            elif len(scheduled_groups) == 1:
                self._fail_requests([scheduled_groups[0].seq_group], error)
            else:
                logger.warning("step %d failed for a batch of %d requests (%r); running each alone to find the cause",
                               self.step_counter, len(scheduled_groups), error)
                for scheduled, metadata in zip(scheduled_groups, request.seq_group_metadata_list):
                    self._execute_alone(scheduled, metadata, stats, request.kv_connector_metadata)

    def _execute_alone(self, scheduled: ScheduledSequenceGroup, metadata: SequenceGroupMetadata, stats: Stats,
                       kv_connector_metadata=None) -> None:
        # No block moves: the failed run applied them before the model ran (they are the
        # scheduler's own, not a request's), and a swap-out repeated now could read a block
        # that a prefill has since written.
        # The group's own KV connector loads and saves go with it (loading twice is harmless).
        if kv_connector_metadata is not None:
            kv_connector_metadata = dataclasses.replace(kv_connector_metadata, requests=[
                r for r in kv_connector_metadata.requests if r.request_id == metadata.request_id])
        request = ExecuteModelRequest(seq_group_metadata_list=[metadata], num_steps=1 + metadata.num_lookahead_slots,
                                      kv_connector_metadata=kv_connector_metadata)
        self._execute_and_process(request, [scheduled], stats)

    def _fail_requests(self, seq_groups: list[SequenceGroup], error: Exception) -> None:
        """End requests that failed inside a step: finish_reason "abort" with a `finish_message`,
        every block back in the pool (the scheduler's abort path), the traceback in the log.
        They are reported at the end of this step like any request that finished in it."""
        for seq_group in seq_groups:
            logger.error("request %s failed inside engine step %d; finishing it", seq_group.request_id,
                         self.step_counter, exc_info=error)
            seq_group.finish_message = "failed inside an engine step; the details are in the engine's log."
            # The failed step may have left its blocks' K/V unwritten: no later request may reuse them.
            self.scheduler.block_manager.forget_computed_blocks(seq_group)
        self.abort_request([g.request_id for g in seq_groups])

    def _report(self, scheduler_outputs: SchedulerOutputs, now: float, stats: Stats,
                skip: set[int] = frozenset()) -> list[RequestOutput]:
        """One output per scheduled or ignored request (unfinished FINAL_ONLY ones excepted),
        but those whose `id` is in `skip` (they ended, and were reported, before this step)."""
        reported = [s.seq_group for s in scheduler_outputs.scheduled_seq_groups if id(s.seq_group) not in skip]
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
    def _partial_outputs(self, scheduled_groups: list[ScheduledSequenceGroup]) -> list[RequestOutput]:
        """Outputs of the scheduled requests still running, in the middle of a multi-step run
        (finished ones are reported once, at the end of the step)."""
        decode = None if self.tokenizer is None else self.detokenizer.decode_token
        return [RequestOutput.from_seq_group(s.seq_group, decode, self.eos_token_id) for s in scheduled_groups
                if not s.seq_group.is_finished()
                and s.seq_group.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY]

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


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    return AutoTokenizer.from_pretrained(name)


def _eos_token_id(tokenizer, hf_config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) and eos else eos
