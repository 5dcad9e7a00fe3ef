"""Prometheus metrics with vLLM's names, fed by the engine's per-step `Stats`.

Mirrors `PrometheusStatLogger` in `vllm/engine/metrics.py` (v0). The engine calls
`logger.log(stats)` after every step (`LLMEngine.add_logger`); this logger turns each
`Stats` into gauges (queue lengths, KV-cache usage), counters (tokens, preemptions) and
histograms (time to first token, time per output token, end-to-end latency), which
`GET /metrics` renders in Prometheus' text format:

    vllm:num_requests_running{model_name="tiny-shakespeare"} 3.0
    vllm:generation_tokens_total{model_name="tiny-shakespeare"} 1234.0
    vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny-shakespeare"} 17.0

Each server gets its own `CollectorRegistry`, so several servers in one process (tests,
notebooks) never share or clash on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from minivllm.engine.metrics import Stats

# No `..._created` sample (a creation timestamp) beside every counter and histogram: vLLM's
# metrics have none, and in a notebook they only clutter the page. (A process-wide switch.)
disable_created_metrics()

# Bucket edges in seconds. vLLM's start at a millisecond for fast GPUs; a CPU run of the
# bundled model lands in the tens-to-hundreds of milliseconds, so both ends are covered.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)

# KVTransferStats field -> help text.
KV_TRANSFER_GAUGES = {
    "num_tokens_loaded": "Tokens whose KV a KV connector loaded from its store.",
    "num_tokens_saved": "Tokens whose KV a KV connector saved to its store.",
    "bytes_loaded": "Bytes of KV loaded by a KV connector.",
    "bytes_saved": "Bytes of KV saved by a KV connector.",
    "load_time_s": "Seconds spent loading KV (reading the store, issuing copies).",
    "save_time_s": "Seconds spent saving KV (waiting for copies, writing the store).",
    "num_load_errors": "KV blocks whose load failed (missing, damaged, store down) and were recomputed.",
    "num_key_mismatches": "KV blocks refused: the stored value named another key (model, dtype, layout, prefix).",
}


class PrometheusStatLogger:
    """A stat logger for `LLMEngine.add_logger` that records into a Prometheus registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests running on the GPU (or CPU).")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to CPU memory.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Fraction of device KV blocks in use (1 = 100%).")
        self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (1 = 100%).")
        # prometheus-client appends "_total" to counters: these export as vllm:..._total.
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed (prefill).")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated (decode).")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds", "Time between consecutive output tokens.", TPOT_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the last token of a request.", E2E_BUCKETS
        )
        # A KV connector's cumulative counts (they come from the worker already summed up).
        self.kv_transfer = {name: gauge(f"vllm:kv_transfer_{name}", doc) for name, doc in KV_TRANSFER_GAUGES.items()}
        # Speculative decoding (vLLM's names); the engine reports cumulative counts, so the
        # counters grow by the difference since the last step that speculated.
        self.spec_decode_draft_acceptance_rate = gauge("vllm:spec_decode_draft_acceptance_rate",
                                                       "Speculative token acceptance rate.")
        self.spec_decode_efficiency = gauge("vllm:spec_decode_efficiency", "Speculative decoding system efficiency.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_emitted_tokens = counter("vllm:spec_decode_num_emitted_tokens", "Number of emitted tokens.")
        self._last_spec_counts = (0, 0, 0)

    def log(self, stats: Stats) -> None:
        """Called by the engine after every step (in the step thread; prometheus-client is thread-safe)."""
        self.num_requests_running.set(stats.num_running_sys)
        self.num_requests_waiting.set(stats.num_waiting_sys)
        self.num_requests_swapped.set(stats.num_swapped_sys)
        self.gpu_cache_usage.set(stats.gpu_cache_usage_sys)
        self.cpu_cache_usage.set(stats.cpu_cache_usage_sys)
        self.num_preemptions.inc(stats.num_preemption_iter)
        self.prompt_tokens.inc(stats.num_prompt_tokens_iter)
        self.generation_tokens.inc(stats.num_generation_tokens_iter)
        for seconds in stats.time_to_first_tokens_iter:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.time_per_output_tokens_iter:
            self.time_per_output_token.observe(seconds)
        for seconds in stats.time_e2e_requests:
            self.e2e_request_latency.observe(seconds)
        if stats.kv_transfer_stats is not None:
            for name, gauge in self.kv_transfer.items():
                gauge.set(getattr(stats.kv_transfer_stats, name))
        if stats.spec_decode_metrics is not None:
            self._log_spec_decode(stats.spec_decode_metrics)

    def _log_spec_decode(self, metrics) -> None:
        if metrics.draft_tokens:  # the rates are nan until a token was proposed
            self.spec_decode_draft_acceptance_rate.set(metrics.draft_acceptance_rate)
            self.spec_decode_efficiency.set(metrics.system_efficiency)
        counts = (metrics.accepted_tokens, metrics.draft_tokens, metrics.emitted_tokens)
        counters = (self.spec_decode_num_accepted_tokens, self.spec_decode_num_draft_tokens,
                    self.spec_decode_num_emitted_tokens)
        for counter, now, before in zip(counters, counts, self._last_spec_counts):
            counter.inc(now - before)
        self._last_spec_counts = counts

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)
