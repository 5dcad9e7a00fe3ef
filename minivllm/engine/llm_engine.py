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

from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.core.snapshot import StepSnapshot, take_snapshot
from minivllm.engine.arg_utils import EngineArgs, EngineConfig
from minivllm.engine.detokenizer import Detokenizer
from minivllm.engine.metrics import StatLoggerBase, Stats
from minivllm.executor.executor_base import ExecutorBase
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import (
    ExecuteModelRequest,
    Sequence,
    SequenceGroup,
    SequenceGroupOutput,
    SequenceOutput,
    SequenceStatus,
)

logger = logging.getLogger(__name__)

PromptInput = str | dict[str, Any]


class LLMEngine:
    """Serves requests over one executor (see the module docstring for a step's anatomy).

    Build it with `LLMEngine.from_engine_args(EngineArgs(...))`. Attributes worth knowing:
    `model_config`, `cache_config` (its `num_gpu_blocks` is the pool size after profiling),
    `scheduler_config`, `scheduler` (and `scheduler.block_manager`), `record_snapshots`
    (set True to keep a `StepSnapshot` per step in `snapshots`, for the visualizations).
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
        outputs: list[SequenceGroupOutput] = []
        if not scheduler_outputs.is_empty():
            request = ExecuteModelRequest(
                seq_group_metadata_list=seq_group_metadata_list,
                blocks_to_swap_in=scheduler_outputs.blocks_to_swap_in,
                blocks_to_swap_out=scheduler_outputs.blocks_to_swap_out,
                blocks_to_copy=scheduler_outputs.blocks_to_copy,
                finished_requests_ids=self._finished_requests_ids,
            )
            self._finished_requests_ids = []
            outputs = self.model_executor.execute_model(request)
        now = time.monotonic()
        stats = self._new_stats(now, scheduler_outputs)
        request_outputs = self._process_model_outputs(outputs, scheduler_outputs, now, stats)
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

    def _process_model_outputs(
        self, outputs: list[SequenceGroupOutput], scheduler_outputs: SchedulerOutputs, now: float, stats: Stats
    ) -> list[RequestOutput]:
        request_outputs = []
        for scheduled, output in zip(scheduler_outputs.scheduled_seq_groups, outputs):
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
                self._process_samples(seq_group, output.samples)
                # Beam search proposes 2 x beam_width candidates but keeps beam_width.
                stats.num_generation_tokens_iter += min(len(output.samples), seq_group.sampling_params.best_of)
            request_outputs.append(self._make_request_output(seq_group, now, stats))
        for seq_group in scheduler_outputs.ignored_seq_groups:
            if seq_group.finish_message:
                logger.warning("request %s: %s", seq_group.request_id, seq_group.finish_message)
            self._finished_requests_ids.append(seq_group.request_id)
            request_outputs.append(self._make_request_output(seq_group, now, stats))
        return request_outputs

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

    # ------------------------------------------------------------------ samples
    def _process_samples(self, seq_group: SequenceGroup, samples: list[SequenceOutput]) -> None:
        """Append each sample to its parent; a parent with several samples forks children."""
        params = seq_group.sampling_params
        existing_finished = seq_group.get_finished_seqs()
        child_seqs: list[tuple[Sequence, Sequence]] = []  # (child, parent); parent continues itself
        for parent in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            child_samples = [s for s in samples if s.parent_seq_id == parent.seq_id]
            if not child_samples:
                # Beam search dropped this beam: it has no future, free it now.
                parent.status = SequenceStatus.FINISHED_ABORTED
                seq_group.remove(parent.seq_id)
                self.scheduler.free_seq(parent)
                continue
            for sample in child_samples[:-1]:
                child = parent.fork(next(self.seq_counter))
                child.append_token_id(sample.output_token, sample.logprobs, sample.rank)
                child_seqs.append((child, parent))
            last = child_samples[-1]
            parent.append_token_id(last.output_token, last.logprobs, last.rank)
            child_seqs.append((parent, parent))
        for seq, _ in child_seqs:
            new_char_count = self.detokenizer.decode_sequence_inplace(seq, params) if params.detokenize else 0
            self._check_stop(seq, new_char_count, params)
        if params.use_beam_search:
            selected, unselected = self._select_beams(seq_group, child_seqs, existing_finished)
        else:
            selected, unselected = child_seqs, []
        self._apply_selection(seq_group, selected, unselected)

    def _apply_selection(self, seq_group: SequenceGroup, selected, unselected) -> None:
        # Fork the new children first, then free finished parents: a child must take its
        # references to the parent's blocks before the parent lets go of them.
        for seq, parent in selected:
            if seq is not parent:
                seq_group.add(seq)
                if not seq.is_finished():
                    self.scheduler.fork_seq(parent, seq)
        for seq, parent in selected:
            if seq is parent and seq.is_finished():
                self.scheduler.free_seq(seq)
        for seq, parent in unselected:
            if seq is parent:
                seq_group.remove(seq.seq_id)
                self.scheduler.free_seq(seq)

    def _select_beams(self, seq_group: SequenceGroup, child_seqs, existing_finished):
        """vLLM v0's beam selection: keep the best `beam_width` finished and running beams.

        Returns (selected, unselected) lists of (seq, parent). Finished beams compete with
        the finished beams of earlier steps; running beams continue unless the search stops
        (`early_stopping`, or no running beam can beat the worst kept finished one).
        """
        params = seq_group.sampling_params
        beam_width = params.best_of

        def score(seq: Sequence, seq_len: int | None = None) -> float:
            return seq.get_beam_search_score(params.length_penalty, seq_len, self.eos_token_id)

        selected, unselected = [], []
        # (seq, parent, is_new) for all finished beams, best first.
        finished = [(s, None, False) for s in existing_finished]
        finished += [(s, p, True) for s, p in child_seqs if s.is_finished()]
        finished.sort(key=lambda x: score(x[0]), reverse=True)
        for seq, parent, is_new in finished[:beam_width]:
            if is_new:
                selected.append((seq, parent))
        for seq, parent, is_new in finished[beam_width:]:
            if is_new:
                unselected.append((seq, parent))
            else:
                seq_group.remove(seq.seq_id)  # an old finished beam pushed out of the top
        running = sorted(((s, p) for s, p in child_seqs if not s.is_finished()),
                         key=lambda x: score(x[0]), reverse=True)
        if not running:
            stop = True
        elif len(finished) < beam_width:
            stop = False
        else:
            stop = self._beam_search_done(params, running[0][0], finished[beam_width - 1][0], score)
        if stop:
            unselected += running
        else:
            selected += running[:beam_width]
            unselected += running[beam_width:]
        return selected, unselected

    def _beam_search_done(self, params: SamplingParams, best_running: Sequence, worst_finished: Sequence, score) -> bool:
        """`early_stopping` as in transformers: True stops at beam_width finished beams;
        False stops when the best running beam, scored now, cannot beat the worst finished;
        "never" scores the best running beam at the longest length it could still reach."""
        if params.early_stopping is True:
            return True
        best_len = None
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_len = max(best_running.get_prompt_len() + params.max_tokens, self.scheduler_config.max_model_len)
        return score(worst_finished) >= score(best_running, best_len)

    # ------------------------------------------------------------------ stopping
    def _check_stop(self, seq: Sequence, new_char_count: int, params: SamplingParams) -> None:
        """Finish `seq` when a stop condition holds (vLLM's StopChecker order)."""
        if seq.get_output_len() < params.min_tokens:
            return
        last_token = seq.get_last_token_id()
        if not params.ignore_eos and last_token == self.eos_token_id:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if last_token in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = last_token
            return
        stop_str = self._find_stop_string(seq, new_char_count, params)
        if stop_str is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop_str
            return
        if seq.get_len() >= self.scheduler_config.max_model_len or seq.get_output_len() >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    @staticmethod
    def _find_stop_string(seq: Sequence, new_char_count: int, params: SamplingParams) -> str | None:
        """Look for a stop string ending in the new text; truncate the output text there."""
        if not new_char_count:
            return None
        for stop_str in params.stop:
            # Only a match that overlaps the new characters can be new.
            start = max(len(seq.output_text) - new_char_count - len(stop_str) + 1, 0)
            index = seq.output_text.find(stop_str, start)
            if index == -1:
                continue
            end = index + len(stop_str) if params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            return stop_str
        return None

    # ------------------------------------------------------------------ outputs
    def _make_request_output(self, seq_group: SequenceGroup, now: float, stats: Stats) -> RequestOutput:
        params = seq_group.sampling_params
        seqs = self._ranked_seqs(seq_group)
        finished = seq_group.is_finished()
        if finished:
            self._on_request_finished(seq_group, now, stats)
        return RequestOutput(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt,
            prompt_token_ids=seq_group.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs_output(seq_group),
            outputs=[self._completion_output(i, seq, params) for i, seq in enumerate(seqs)],
            finished=finished,
            metrics=seq_group.metrics,
        )

    def _ranked_seqs(self, seq_group: SequenceGroup) -> list[Sequence]:
        """The `n` sequences to report: all of them in creation order when n == best_of
        (stable indices while streaming), else the best n (beam score / cumulative logprob)."""
        params = seq_group.sampling_params
        seqs = seq_group.get_seqs()
        if params.best_of == params.n and not params.use_beam_search:
            return seqs
        if params.use_beam_search:
            def key(s):
                return s.get_beam_search_score(params.length_penalty, eos_token_id=self.eos_token_id)
        else:
            def key(s):
                return s.get_cumulative_logprob()
        return sorted(seqs, key=key, reverse=True)[: params.n]

    def _completion_output(self, index: int, seq: Sequence, params: SamplingParams) -> CompletionOutput:
        want_logprobs = params.logprobs is not None
        return CompletionOutput(
            index=index,
            text=seq.output_text,
            token_ids=list(seq.get_output_token_ids()),
            cumulative_logprob=seq.get_cumulative_logprob() if want_logprobs or params.use_beam_search else None,
            logprobs=self._sample_logprobs(seq) if want_logprobs else None,
            finish_reason=SequenceStatus.get_finished_reason(seq.status),
            stop_reason=seq.stop_reason,
        )

    def _sample_logprobs(self, seq: Sequence) -> list[dict[int, Logprob]]:
        return [
            self._logprob_dict(entry, token, rank)
            for entry, token, rank in zip(seq.output_logprobs, seq.get_output_token_ids(), seq.output_ranks)
        ]

    def _prompt_logprobs_output(self, seq_group: SequenceGroup):
        if seq_group.prompt_logprobs is None:
            return None
        tokens = seq_group.prompt_token_ids
        return [
            None if entry is None else self._logprob_dict(entry, tokens[i], seq_group.prompt_ranks[i])
            for i, entry in enumerate(seq_group.prompt_logprobs)
        ]

    def _logprob_dict(self, entry: dict[int, float], chosen: int, chosen_rank: int | None) -> dict[int, Logprob]:
        """{token: Logprob}; the top-N alternatives are ranked by their order (1 = best)."""
        others = sorted((t for t in entry if t != chosen), key=lambda t: entry[t], reverse=True)
        ranks = {t: i + 1 for i, t in enumerate(sorted(entry, key=lambda t: entry[t], reverse=True))}
        result = {chosen: Logprob(entry[chosen], chosen_rank, self.detokenizer.decode_token(chosen))}
        for token in others:
            result[token] = Logprob(entry[token], ranks[token], self.detokenizer.decode_token(token))
        return result

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
