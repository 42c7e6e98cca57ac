"""Stat loggers: a periodic log line and Prometheus metrics under the ``xlm:`` prefix."""

from __future__ import annotations

import time
from typing import Any

from xlm.logger import init_logger
from xlm.metrics.stats import IterationStats

logger = init_logger(__name__)

_FINISH_REASONS = ("stop", "length", "abort", "error")


class StatLoggerBase:
    """Receives scheduler stats and iteration stats after each engine step."""

    def record(self, scheduler_stats: Any | None, iteration_stats: IterationStats | None) -> None:
        """Account one step."""

    def _record_host_kv(self, s: Any) -> None:
        """The host KV tier's usage and cumulative hits and bytes (zeros without a tier)."""
        self.host_kv_cache_usage.set(getattr(s, "host_kv_cache_usage", 0.0))
        counters = (
            self.host_kv_cache_hits,
            self.host_kv_bytes_to_host,
            self.host_kv_bytes_to_device,
        )
        names = ("host_kv_cache_hits", "host_kv_bytes_to_host", "host_kv_bytes_to_device")
        for i, (c, name) in enumerate(zip(counters, names)):
            self._last_host[i] = _inc(c, getattr(s, name, 0), self._last_host[i])

    def record_aborted(self, count: int = 1) -> None:
        """Account requests aborted by the front end (client gone, deadline)."""

    def log(self) -> None:
        """Periodic hook (the server calls it every XLM_LOG_STATS_INTERVAL seconds)."""


class LoggingStatLogger(StatLoggerBase):
    """One log line per interval: throughput, running/waiting, KV usage, prefix hits."""

    def __init__(self) -> None:
        self.last_log = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.scheduler_stats: Any = None

    def record(self, scheduler_stats: Any | None, iteration_stats: IterationStats | None) -> None:
        """Accumulate token counts; keep the latest scheduler stats."""
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        """Log throughput since the last call."""
        now = time.monotonic()
        elapsed = max(now - self.last_log, 1e-9)
        s = self.scheduler_stats
        if s is None and not (self.num_prompt_tokens or self.num_generation_tokens):
            self.last_log = now
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.num_prompt_tokens / elapsed,
            self.num_generation_tokens / elapsed,
            getattr(s, "num_running_reqs", 0),
            getattr(s, "num_waiting_reqs", 0),
            100 * getattr(s, "kv_cache_usage", 0.0),
            100 * _hit_rate(s),
        )
        self.last_log = now
        self.num_prompt_tokens = self.num_generation_tokens = 0


def _hit_rate(s: Any) -> float:
    queries = getattr(s, "prefix_cache_queries", 0)
    return getattr(s, "prefix_cache_hits", 0) / queries if queries else 0.0


_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
]
_TOKEN_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]


class PrometheusStatLogger(StatLoggerBase):
    """vLLM-style Prometheus metrics in a private registry (served at /metrics)."""

    def __init__(self, model_name: str, registry: Any | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("xlm:num_requests_running", "Requests running.")
        self.num_requests_waiting = gauge("xlm:num_requests_waiting", "Requests waiting.")
        self.kv_cache_usage = gauge("xlm:kv_cache_usage_perc", "KV cache usage (1 = 100%).")
        self.programs_ready = gauge(
            "xlm:programs_ready",
            "Step programs compiled and ready (the rest compile in the background).",
        )
        self.programs_total = gauge("xlm:programs_total", "Step programs the engine may run.")
        self.prefix_cache_queries = counter(
            "xlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "xlm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("xlm:num_preemptions", "Cumulative preemptions.")
        self.host_kv_cache_usage = gauge(
            "xlm:host_kv_cache_usage_perc", "Host KV tier usage (1 = every slot holds a block)."
        )
        self.host_kv_cache_hits = counter(
            "xlm:host_kv_cache_hits", "Prompt tokens loaded from the host KV tier, not computed."
        )
        self.host_kv_bytes_to_host = counter(
            "xlm:host_kv_bytes_to_host", "Bytes of KV blocks copied from the device to the host."
        )
        self.host_kv_bytes_to_device = counter(
            "xlm:host_kv_bytes_to_device", "Bytes of KV blocks copied from the host to the device."
        )
        self.spec_num_drafts = counter(
            "xlm:spec_decode_num_drafts", "Speculative decoding: requests' proposals verified."
        )
        self.spec_num_draft_tokens = counter(
            "xlm:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."
        )
        self.spec_num_accepted_tokens = counter(
            "xlm:spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."
        )
        self.spec_acceptance_rate = gauge(
            "xlm:spec_decode_acceptance_rate", "Accepted of proposed tokens, cumulative."
        )
        self.spec_mean_accepted_length = gauge(
            "xlm:spec_decode_mean_accepted_length",
            "Tokens per verification: accepted proposals plus the one sampled, cumulative.",
        )
        self.prompt_tokens = counter("xlm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("xlm:generation_tokens", "Generation tokens produced.")
        success = Counter(
            "xlm:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in _FINISH_REASONS
        }
        self.ttft = histogram(
            "xlm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "xlm:inter_token_latency_seconds", "Inter-token latency.", _TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "xlm:request_time_per_output_token_seconds",
            "Mean time per output token of each request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "xlm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "xlm:request_queue_time_seconds", "Time requests spent waiting.", _LATENCY_BUCKETS
        )
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_host = [0, 0, 0]
        self._last_spec = [0, 0, 0]

    def record(self, scheduler_stats: Any | None, iteration_stats: IterationStats | None) -> None:
        """Update gauges, counters and histograms."""
        s = scheduler_stats
        if s is not None:
            self.num_requests_running.set(s.num_running_reqs)
            self.num_requests_waiting.set(s.num_waiting_reqs)
            self.kv_cache_usage.set(s.kv_cache_usage)
            self.programs_ready.set(s.programs_ready)
            self.programs_total.set(s.programs_total)
            self._last_queries = _inc(
                self.prefix_cache_queries, s.prefix_cache_queries, self._last_queries
            )
            self._last_hits = _inc(self.prefix_cache_hits, s.prefix_cache_hits, self._last_hits)
            self._last_preemptions = _inc(
                self.num_preemptions, s.num_preemptions, self._last_preemptions
            )
            self._record_host_kv(s)
            if s.spec_num_drafts:
                spec = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
                counters = (
                    self.spec_num_drafts,
                    self.spec_num_draft_tokens,
                    self.spec_num_accepted_tokens,
                )
                for i, (c, value) in enumerate(zip(counters, spec)):
                    self._last_spec[i] = _inc(c, value, self._last_spec[i])
                self.spec_acceptance_rate.set(s.spec_acceptance_rate)
                self.spec_mean_accepted_length.set(s.spec_mean_accepted_length)
        it = iteration_stats
        if it is None:
            return
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for ttft in it.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies:
            self.itl.observe(itl)
        for queue_time in it.queue_times:
            self.queue_time.observe(queue_time)
        for fin in it.finished_requests:
            counter = self.request_success.get(fin.finish_reason)
            if counter is not None:
                counter.inc()
            self.e2e.observe(fin.e2e_latency)
            if fin.mean_time_per_output_token is not None:
                self.tpot.observe(fin.mean_time_per_output_token)
            if fin.queue_time is not None:
                self.queue_time.observe(fin.queue_time)

    def _record_host_kv(self, s: Any) -> None:
        """The host KV tier's usage and cumulative hits and bytes (zeros without a tier)."""
        self.host_kv_cache_usage.set(getattr(s, "host_kv_cache_usage", 0.0))
        counters = (
            self.host_kv_cache_hits,
            self.host_kv_bytes_to_host,
            self.host_kv_bytes_to_device,
        )
        names = ("host_kv_cache_hits", "host_kv_bytes_to_host", "host_kv_bytes_to_device")
        for i, (c, name) in enumerate(zip(counters, names)):
            self._last_host[i] = _inc(c, getattr(s, name, 0), self._last_host[i])

    def record_aborted(self, count: int = 1) -> None:
        """Count requests the front end aborted (disconnects, shutdown)."""
        self.request_success["abort"].inc(count)


def _inc(counter: Any, total: int, last: int) -> int:
    """Advance a Prometheus counter to a cumulative total; returns the new last value."""
    if total > last:
        counter.inc(total - last)
    return max(total, last)
