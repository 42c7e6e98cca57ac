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

    def record(
        self,
        scheduler_stats: Any | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        """Account one step of engine `engine_idx` (the data-parallel rank; 0 without)."""

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

    def record(
        self,
        scheduler_stats: Any | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        """Accumulate token counts (all engines); keep the latest scheduler stats."""
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
    """vLLM-style Prometheus metrics in a private registry (served at /metrics), labelled
    by `model_name` and `engine` (the data-parallel rank whose steps they count)."""

    def __init__(
        self, model_name: str, registry: Any | None = None, engine_indexes: Any = (0,)
    ) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._families = _make_families(self.registry)
        self._engines: dict[int, _EngineMetrics] = {}
        for engine_idx in engine_indexes:
            self._engine(engine_idx)

    def _engine(self, engine_idx: int) -> _EngineMetrics:
        metrics = self._engines.get(engine_idx)
        if metrics is None:
            metrics = _EngineMetrics(self._families, self.model_name, str(engine_idx))
            self._engines[engine_idx] = metrics
        return metrics

    def record(
        self,
        scheduler_stats: Any | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        """Update gauges, counters and histograms of the engine that ran the step."""
        self._engine(engine_idx).record(scheduler_stats, iteration_stats)

    def record_aborted(self, count: int = 1) -> None:
        """Count requests the front end aborted (disconnects, shutdown) under engine 0."""
        self._engine(min(self._engines, default=0)).request_success["abort"].inc(count)


_GAUGES = {
    "num_requests_running": ("xlm:num_requests_running", "Requests running."),
    "num_requests_waiting": ("xlm:num_requests_waiting", "Requests waiting."),
    "kv_cache_usage": ("xlm:kv_cache_usage_perc", "KV cache usage (1 = 100%)."),
    "programs_ready": (
        "xlm:programs_ready",
        "Step programs compiled and ready (the rest compile in the background).",
    ),
    "programs_total": ("xlm:programs_total", "Step programs the engine may run."),
    "host_kv_cache_usage": (
        "xlm:host_kv_cache_usage_perc",
        "Host KV tier usage (1 = every slot holds a block).",
    ),
    "spec_acceptance_rate": (
        "xlm:spec_decode_acceptance_rate",
        "Accepted of proposed tokens, cumulative.",
    ),
    "spec_mean_accepted_length": (
        "xlm:spec_decode_mean_accepted_length",
        "Tokens per verification: accepted proposals plus the one sampled, cumulative.",
    ),
}
_COUNTERS = {
    "prefix_cache_queries": (
        "xlm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": ("xlm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("xlm:num_preemptions", "Cumulative preemptions."),
    "host_kv_cache_hits": (
        "xlm:host_kv_cache_hits",
        "Prompt tokens loaded from the host KV tier, not computed.",
    ),
    "host_kv_bytes_to_host": (
        "xlm:host_kv_bytes_to_host",
        "Bytes of KV blocks copied from the device to the host.",
    ),
    "host_kv_bytes_to_device": (
        "xlm:host_kv_bytes_to_device",
        "Bytes of KV blocks copied from the host to the device.",
    ),
    "spec_num_drafts": (
        "xlm:spec_decode_num_drafts",
        "Speculative decoding: requests' proposals verified.",
    ),
    "spec_num_draft_tokens": (
        "xlm:spec_decode_num_draft_tokens",
        "Speculative decoding: tokens proposed.",
    ),
    "spec_num_accepted_tokens": (
        "xlm:spec_decode_num_accepted_tokens",
        "Speculative decoding: proposed tokens accepted.",
    ),
    "prompt_tokens": ("xlm:prompt_tokens", "Prefill tokens processed."),
    "generation_tokens": ("xlm:generation_tokens", "Generation tokens produced."),
}
_HISTOGRAMS = {
    "ttft": ("xlm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
    "itl": ("xlm:inter_token_latency_seconds", "Inter-token latency.", _TOKEN_LATENCY_BUCKETS),
    "tpot": (
        "xlm:request_time_per_output_token_seconds",
        "Mean time per output token of each request.",
        _TOKEN_LATENCY_BUCKETS,
    ),
    "e2e": ("xlm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS),
    "queue_time": (
        "xlm:request_queue_time_seconds",
        "Time requests spent waiting.",
        _LATENCY_BUCKETS,
    ),
}
_LABELS = ["model_name", "engine"]


def _make_families(registry: Any) -> dict[str, Any]:
    """Every metric family once per registry (each engine binds its own labels)."""
    from prometheus_client import Counter, Gauge, Histogram

    families: dict[str, Any] = {}
    for attr, (name, doc) in _GAUGES.items():
        families[attr] = Gauge(name, doc, _LABELS, registry=registry)
    for attr, (name, doc) in _COUNTERS.items():
        families[attr] = Counter(name, doc, _LABELS, registry=registry)
    for attr, (name, doc, buckets) in _HISTOGRAMS.items():
        families[attr] = Histogram(name, doc, _LABELS, buckets=buckets, registry=registry)
    families["request_success"] = Counter(
        "xlm:request_success",
        "Finished requests by finish reason.",
        _LABELS + ["finished_reason"],
        registry=registry,
    )
    return families


class _EngineMetrics:
    """One engine's labelled metrics and the cumulative totals it last reported."""

    def __init__(self, families: dict[str, Any], model_name: str, engine: str) -> None:
        for attr in (*_GAUGES, *_COUNTERS, *_HISTOGRAMS):
            setattr(self, attr, families[attr].labels(model_name, engine))
        self.request_success = {
            reason: families["request_success"].labels(model_name, engine, reason)
            for reason in _FINISH_REASONS
        }
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_host = [0, 0, 0]
        self._last_spec = [0, 0, 0]

    def record(self, s: Any | None, it: IterationStats | None) -> None:
        """Update gauges, counters and histograms."""
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
        if it is not None:
            self._record_iteration(it)

    def _record_iteration(self, it: IterationStats) -> None:
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


def _inc(counter: Any, total: int, last: int) -> int:
    """Advance a Prometheus counter to a cumulative total; returns the new last value."""
    if total > last:
        counter.inc(total - last)
    return max(total, last)
