"""Engine metrics: a `Stats` record per step, and a logger that prints a periodic line.

Mirrors `vllm/engine/metrics.py` and `metrics_types.py` (v0), with the same field names, so
a Prometheus logger (`minivllm/entrypoints/openai/metrics.py`) reads the same record:

    *_sys   the state of the system after the step (queue lengths, cache usage)
    *_iter  what happened during this step (tokens, preemptions, latencies observed)
    *_requests  one entry per request that finished in this step

    engine.add_logger("logging", LoggingStatLogger(local_interval=5.0))
    # ... every 5 s: "Avg prompt throughput: ... tokens/s, ... GPU KV cache usage: 12.5%, ..."

`EngineStatsMixin` gives `LLMEngine` vLLM's `add_logger` / `remove_logger` and fills the record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from minivllm.sequence import SequenceGroup, SequenceStatus
from minivllm.spec_decode.metrics import SpecDecodeWorkerMetrics

logger = logging.getLogger("minivllm.engine")

_DEFAULT_LOG_INTERVAL_S = 5.0
_MS_PER_S = 1000.0


@dataclass
class Stats:
    """One step's metrics (times in seconds, usages as fractions in [0, 1])."""

    now: float
    # System state after the step.
    num_running_sys: int
    num_waiting_sys: int
    num_swapped_sys: int
    gpu_cache_usage_sys: float
    cpu_cache_usage_sys: float
    gpu_prefix_cache_hit_rate: float  # -1.0 when prefix caching is off
    # This step.
    num_prompt_tokens_iter: int = 0
    num_generation_tokens_iter: int = 0
    num_preemption_iter: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    time_per_output_tokens_iter: list[float] = field(default_factory=list)
    # Requests that finished in this step.
    time_e2e_requests: list[float] = field(default_factory=list)
    time_in_queue_requests: list[float] = field(default_factory=list)
    num_prompt_tokens_requests: list[int] = field(default_factory=list)
    num_generation_tokens_requests: list[int] = field(default_factory=list)
    finished_reason_requests: list[str] = field(default_factory=list)
    # Speculative decoding's cumulative counts, when a step speculated (else None).
    spec_decode_metrics: SpecDecodeWorkerMetrics | None = None
    # The KV connector's cumulative counts (`KVTransferStats`), with a connector.
    kv_transfer_stats: object | None = None


class StatLoggerBase:
    """Anything with `log(stats)`; `LLMEngine.add_logger` calls it after every step."""

    def log(self, stats: Stats) -> None:
        raise NotImplementedError


class EngineStatsMixin:
    """`LLMEngine`'s stat loggers (`self.stat_loggers`) and the `Stats` each step fills."""

    def add_logger(self, logger_name: str, stat_logger: StatLoggerBase) -> None:
        if logger_name in self.stat_loggers:
            raise KeyError(f"a logger named {logger_name!r} already exists.")
        self.stat_loggers[logger_name] = stat_logger

    def remove_logger(self, logger_name: str) -> None:
        if logger_name not in self.stat_loggers:
            raise KeyError(f"no logger named {logger_name!r}.")
        del self.stat_loggers[logger_name]

    def _new_stats(self, now: float, scheduler_outputs) -> Stats:
        return Stats(now=now, num_running_sys=0, num_waiting_sys=0, num_swapped_sys=0,
                     gpu_cache_usage_sys=0.0, cpu_cache_usage_sys=0.0, gpu_prefix_cache_hit_rate=0.0,
                     num_preemption_iter=scheduler_outputs.preempted)

    def _log_stats(self, stats: Stats) -> None:
        """Fill in the system's state after the step, then hand the record to every logger."""
        scheduler = self.scheduler
        num_gpu, num_cpu = self.cache_config.num_gpu_blocks, self.cache_config.num_cpu_blocks
        stats.num_running_sys = len(scheduler.running)
        stats.num_waiting_sys = len(scheduler.waiting)
        stats.num_swapped_sys = len(scheduler.swapped)
        stats.gpu_cache_usage_sys = 1.0 - scheduler.block_manager.get_num_free_gpu_blocks() / num_gpu
        stats.cpu_cache_usage_sys = 1.0 - scheduler.block_manager.get_num_free_cpu_blocks() / num_cpu if num_cpu else 0.0
        stats.gpu_prefix_cache_hit_rate = scheduler.get_prefix_cache_hit_rate()
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats)

    @staticmethod
    def _record_token_times(seq_group: SequenceGroup, now: float, stats: Stats) -> None:
        """A token came back for `seq_group`: its time to first token, or since the last one."""
        metrics = seq_group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            stats.time_to_first_tokens_iter.append(now - metrics.arrival_time)
        else:
            stats.time_per_output_tokens_iter.append(now - metrics.last_token_time)
        metrics.last_token_time = now

    @staticmethod
    def _record_finished_request(seq_group: SequenceGroup, now: float, stats: Stats) -> None:
        metrics = seq_group.metrics
        stats.time_e2e_requests.append(now - metrics.arrival_time)
        if metrics.time_in_queue is not None:
            stats.time_in_queue_requests.append(metrics.time_in_queue)
        stats.num_prompt_tokens_requests.append(len(seq_group.prompt_token_ids))
        stats.num_generation_tokens_requests.append(sum(s.get_output_len() for s in seq_group.get_seqs()))
        reasons = [SequenceStatus.get_finished_reason(s.status) for s in seq_group.get_seqs()]
        stats.finished_reason_requests.append(reasons[0] or "")


class LoggingStatLogger(StatLoggerBase):
    """Accumulates steps and logs one summary line every `local_interval` seconds.

    The line reports throughput since the last line, the current queues and KV-cache usage,
    the prefix-cache hit rate, preemptions, and mean TTFT / TPOT / queue time (ms).
    """

    def __init__(self, local_interval: float = _DEFAULT_LOG_INTERVAL_S, log_fn=None) -> None:
        self.local_interval = local_interval
        self.log_fn = log_fn or logger.info
        self.last_local_log = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.queue_times: list[float] = []

    def log(self, stats: Stats) -> None:
        self.num_prompt_tokens += stats.num_prompt_tokens_iter
        self.num_generation_tokens += stats.num_generation_tokens_iter
        self.num_preemptions += stats.num_preemption_iter
        self.ttfts += stats.time_to_first_tokens_iter
        self.tpots += stats.time_per_output_tokens_iter
        self.queue_times += stats.time_in_queue_requests
        elapsed = stats.now - self.last_local_log
        if elapsed >= self.local_interval:
            self.log_fn(self.format_line(stats, elapsed))
            if stats.spec_decode_metrics is not None:
                self.log_fn(format_spec_decode_line(stats.spec_decode_metrics))
            self.last_local_log = stats.now
            self._reset()

    def format_line(self, stats: Stats, elapsed: float) -> str:
        elapsed = max(elapsed, 1e-9)
        return (
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running_sys} reqs, Swapped: {stats.num_swapped_sys} reqs, "
            f"Pending: {stats.num_waiting_sys} reqs, "
            f"GPU KV cache usage: {stats.gpu_cache_usage_sys * 100:.1f}%, "
            f"CPU KV cache usage: {stats.cpu_cache_usage_sys * 100:.1f}%, "
            f"Prefix cache hit rate: {_hit_rate(stats.gpu_prefix_cache_hit_rate)}, "
            f"Preemptions: {self.num_preemptions}, "
            f"TTFT: {_mean_ms(self.ttfts)}, TPOT: {_mean_ms(self.tpots)}, "
            f"Queue time: {_mean_ms(self.queue_times)}"
        )


def format_spec_decode_line(metrics: SpecDecodeWorkerMetrics) -> str:
    """vLLM's "Speculative metrics" line (cumulative counts)."""
    return (
        f"Speculative metrics: Draft acceptance rate: {metrics.draft_acceptance_rate:.3f}, "
        f"System efficiency: {metrics.system_efficiency:.3f}, "
        f"Number of speculative tokens: {metrics.num_spec_tokens}, "
        f"Number of accepted tokens: {metrics.accepted_tokens}, "
        f"Number of draft tokens: {metrics.draft_tokens}, "
        f"Number of emitted tokens: {metrics.emitted_tokens}."
    )


def _hit_rate(rate: float) -> str:
    # The block manager reports -1 when prefix caching is off (as vLLM v0 does).
    return "off" if rate < 0 else f"{rate * 100:.1f}%"


def _mean_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{sum(values) / len(values) * _MS_PER_S:.1f} ms"
