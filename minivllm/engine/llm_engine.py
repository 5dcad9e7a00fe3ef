"""The engine: requests in, one model step at a time, `RequestOutput`s out.

Mirrors `vllm/engine/llm_engine.py` (v0, ~0.6). One `step()`:

    1. schedule    the Scheduler picks the batch and the block moves (swap, copy-on-write)
    2. execute     the executor's worker applies the moves, runs the model, samples
    3. process     append the sampled tokens (forking sequences for n > 1 and beam search),
                   detokenize, check stop conditions, free finished sequences' blocks
    4. report      one RequestOutput per request that advanced (cumulative text), metrics

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

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from minivllm.core.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutputs
from minivllm.core.snapshot import StepSnapshot, take_snapshot
from minivllm.engine.arg_utils import EngineArgs, EngineConfig
from minivllm.engine.detokenizer import Detokenizer
from minivllm.engine.metrics import StatLoggerBase, Stats
from minivllm.engine.output_processor import SequenceGroupOutputProcessor, StopChecker
from minivllm.executor.executor_base import ExecutorBase
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import (ExecuteModelRequest, Sequence, SequenceGroup, SequenceGroupMetadata,
                               SequenceGroupOutput, SequenceStatus)

logger = logging.getLogger(__name__)

PromptInput = str | dict[str, Any]


class LLMEngine:
    """Serves requests over one executor (see the module docstring for a step's anatomy).

    Build it with `LLMEngine.from_engine_args(EngineArgs(...))`. Attributes worth knowing:
    `model_config`, `cache_config` (its `num_gpu_blocks` is the pool size after profiling),
    `scheduler_config`, `scheduler` (and `scheduler.block_manager`), `record_snapshots`
    (set True to keep a `StepSnapshot` per step in `snapshots`, for the visualizations; each
    includes the block manager's full state, so keep the pool small when recording long runs).
    """

    def __init__(self, engine_config: EngineConfig, executor_class: type[ExecutorBase] = UniProcExecutor) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.device_config = engine_config.device_config
        self.tokenizer = _load_tokenizer(self.model_config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_id = _eos_token_id(self.tokenizer, self.model_config.hf_config)
        self.vocab_size = self.model_config.hf_config.vocab_size
        self.seq_counter = itertools.count()
        self.model_executor = executor_class(
            self.model_config,
            self.cache_config,
            self.scheduler_config,
            self.device_config,
            engine_config.parallel_config,
            attn_backend=engine_config.attention_backend,
            enforce_eager=engine_config.enforce_eager,
        )
        self._initialize_kv_caches()
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)
        self.output_processor = SequenceGroupOutputProcessor(
            self.scheduler,
            self.detokenizer,
            StopChecker(self.scheduler_config.max_model_len, self.eos_token_id),
            self.seq_counter,
        )
        self.stat_loggers: dict[str, StatLoggerBase] = {}
        self.record_snapshots = False
        self.snapshots: list[StepSnapshot] = []
        self.step_counter = 0
        # Requests finished or aborted since the last step: workers drop their state.
        self._finished_requests_ids: list[str] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def _initialize_kv_caches(self) -> None:
        num_gpu_blocks, num_cpu_blocks = self.model_executor.determine_num_available_blocks()
        self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        logger.info("KV cache: %d GPU blocks, %d CPU blocks of %d tokens",
                    num_gpu_blocks, num_cpu_blocks, self.cache_config.block_size)

    def get_tokenizer(self):
        return self.tokenizer

    # ================================================================== requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. `prompt` is text or `{"prompt_token_ids": [...]}` (optionally with
        "prompt"). Raises ValueError for an empty prompt, unknown token ids, a duplicate id,
        or a priority without the priority policy. A prompt longer than `max_model_len` is
        accepted and finishes at the next step with finish_reason "length" and a message.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}.")
        if any(g.request_id == request_id for g in self._unfinished_groups()):
            raise ValueError(f"request id {request_id!r} is already running.")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        if priority != 0 and self.scheduler_config.policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority'.")
        prompt_text, prompt_token_ids = self._process_prompt(prompt)
        params = self._finalize_params(params)
        seqs = [Sequence(next(self.seq_counter), prompt_text, prompt_token_ids,
                         self.cache_config.block_size, self.eos_token_id)]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        seq_group = SequenceGroup(request_id, seqs, params, arrival_time, priority)
        self.scheduler.add_seq_group(seq_group)

    def _process_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {prompt!r}.")
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token.")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}.")
        return text, token_ids

    def _finalize_params(self, params: SamplingParams) -> SamplingParams:
        """A private copy with the model's EOS among the stop ids (for min_tokens)."""
        params = params.clone()
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            params.all_stop_token_ids.add(self.eos_token_id)
        if params.max_tokens is None:
            params.max_tokens = self.scheduler_config.max_model_len
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

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def _unfinished_groups(self) -> Iterable[SequenceGroup]:
        return itertools.chain(self.scheduler.waiting, self.scheduler.running, self.scheduler.swapped)

    # ================================================================== a step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler + model step; outputs of the requests it advanced or finished."""
        seq_group_metadata_list, scheduler_outputs = self.scheduler.schedule()
        snapshot = None
        if self.record_snapshots:
            snapshot = take_snapshot(self.scheduler, scheduler_outputs, self.step_counter,
                                     include_block_manager=True)
        stats = self._new_stats(time.monotonic(), scheduler_outputs)
        if not scheduler_outputs.is_empty():
            steps_applied: list[int] = []

            def apply_step_outputs(outputs: list[SequenceGroupOutput]) -> None:
                # Called by the worker as each step's samples reach the host: in a multi-step
                # run, while the GPU already computes the next step (the host work overlaps).
                self._apply_step(outputs, scheduler_outputs.scheduled_seq_groups, stats, first=not steps_applied)
                steps_applied.append(1)

            request = ExecuteModelRequest(
                seq_group_metadata_list=seq_group_metadata_list,
                blocks_to_swap_in=scheduler_outputs.blocks_to_swap_in,
                blocks_to_swap_out=scheduler_outputs.blocks_to_swap_out,
                blocks_to_copy=scheduler_outputs.blocks_to_copy,
                finished_requests_ids=self._finished_requests_ids,
                num_steps=self._num_steps(seq_group_metadata_list),
                output_callback=apply_step_outputs,
            )
            self._finished_requests_ids = []
            self.model_executor.execute_model(request)
        now = stats.now = time.monotonic()
        request_outputs = self._report(scheduler_outputs, now, stats)
        self.scheduler.free_finished_seq_groups()
        self._fill_system_stats(stats)
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats)
        if snapshot is not None:
            snapshot.finished.extend(o.request_id for o in request_outputs if o.finished)
            snapshot.time = now
            self.snapshots.append(snapshot)
        self.step_counter += 1
        return request_outputs

    def _num_steps(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> int:
        """Steps to ask the worker for: a multi-step run when some decode reserved lookahead slots."""
        return 1 + max((m.num_lookahead_slots for m in seq_group_metadata_list), default=0)

    def _apply_step(self, outputs: list[SequenceGroupOutput], scheduled_groups: list[ScheduledSequenceGroup],
                    stats: Stats, first: bool) -> None:
        """One step's samples, in order: the first step of the batch, or a later one of a multi-step run."""
        if first:
            self._apply_first_step(outputs, scheduled_groups, time.monotonic(), stats)
        else:
            self._apply_later_step(outputs, scheduled_groups, stats)

    def _report(self, scheduler_outputs: SchedulerOutputs, now: float, stats: Stats) -> list[RequestOutput]:
        """One output per scheduled or ignored request (unfinished FINAL_ONLY ones excepted)."""
        reported = [s.seq_group for s in scheduler_outputs.scheduled_seq_groups]
        for seq_group in scheduler_outputs.ignored_seq_groups:
            if seq_group.finish_message:
                logger.warning("request %s: %s", seq_group.request_id, seq_group.finish_message)
            reported.append(seq_group)
        request_outputs = [self._make_request_output(seq_group, now, stats) for seq_group in reported]
        return [output for output in request_outputs if output is not None]

    def _apply_later_step(self, outputs: list[SequenceGroupOutput], scheduled_groups: list[ScheduledSequenceGroup],
                          stats: Stats) -> None:
        """A later step of a multi-step run: each row computed the K/V of the token it was
        fed (the one sampled a step earlier) and sampled the next. A request that stopped
        in an earlier step ignores the rest (those tokens were computed past its end)."""
        for scheduled, output in zip(scheduled_groups, outputs):
            seq_group = scheduled.seq_group
            if output.samples and not seq_group.is_finished():
                seq_group.update_num_computed_tokens(1)
                self.output_processor.process_outputs(seq_group, output.samples)
                stats.num_generation_tokens_iter += 1

    def _apply_first_step(self, outputs: list[SequenceGroupOutput], scheduled_groups: list[ScheduledSequenceGroup],
                          now: float, stats: Stats) -> None:
        """The (first) step: prefill chunks and decodes computed, one sample per running sequence."""
        for scheduled, output in zip(scheduled_groups, outputs):
            seq_group = scheduled.seq_group
            is_prefill = seq_group.is_prefill()
            first_computed = seq_group.get_unfinished_seqs()[0].get_num_computed_tokens()
            # The step computed these tokens' K/V; the tokens sampled below are not yet in the cache.
            seq_group.update_num_computed_tokens(scheduled.token_chunk_size)
            if is_prefill:
                stats.num_prompt_tokens_iter += scheduled.token_chunk_size
            if output.prompt_logprobs:
                self._record_prompt_logprobs(seq_group, output, first_computed)
            if output.samples:
                self._update_metrics(seq_group, now, stats)
                self.output_processor.process_outputs(seq_group, output.samples)
                # Beam search proposes 2 x beam_width candidates but keeps beam_width.
                stats.num_generation_tokens_iter += min(len(output.samples), seq_group.sampling_params.best_of)

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
        return RequestOutput.from_seq_group(seq_group, self.detokenizer.decode_token, self.eos_token_id)

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
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) and eos else eos
