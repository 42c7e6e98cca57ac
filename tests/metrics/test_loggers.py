"""The Prometheus and log-line stat loggers."""

from __future__ import annotations

from prometheus_client import generate_latest

from xlm.core.outputs import EngineCoreOutput, SchedulerStats
from xlm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from xlm.metrics.stats import RequestStatsTracker


def test_prometheus_logger_counts_deltas_and_histograms():
    logger = PrometheusStatLogger("m")
    tracker = RequestStatsTracker()
    tracker.add("a", 0.0, 4)
    it = tracker.update([EngineCoreOutput("a", [7], "stop")], now=0.25)
    it.queue_times = [0.01, 0.02]
    stats = SchedulerStats(
        num_running_reqs=2,
        kv_cache_usage=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        num_preemptions=1,
    )
    logger.record(stats, it)
    logger.record(SchedulerStats(prefix_cache_queries=12, prefix_cache_hits=4), None)
    logger.record_aborted(2)
    text = generate_latest(logger.registry).decode()
    assert 'xlm:num_requests_running{engine="0",model_name="m"} 0.0' in text  # the latest snapshot
    assert 'xlm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0' in text
    assert 'xlm:num_preemptions_total{engine="0",model_name="m"} 1.0' in text
    assert 'xlm:prefix_cache_queries_total{engine="0",model_name="m"} 12.0' in text
    assert 'xlm:prefix_cache_hits_total{engine="0",model_name="m"} 4.0' in text
    assert 'xlm:prompt_tokens_total{engine="0",model_name="m"} 4.0' in text
    assert 'xlm:generation_tokens_total{engine="0",model_name="m"} 1.0' in text
    assert 'xlm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in text
    assert (
        'xlm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0' in text
    )
    assert 'xlm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0' in text
    assert 'xlm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.25' in text
    assert 'xlm:request_queue_time_seconds_count{engine="0",model_name="m"} 2.0' in text


def test_prometheus_logger_counts_the_host_kv_tier():
    logger = PrometheusStatLogger("m")
    stats = SchedulerStats(
        host_kv_cache_usage=0.25,
        host_kv_cache_hits=64,
        host_kv_bytes_to_host=4096,
        host_kv_bytes_to_device=1024,
    )
    logger.record(stats, None)
    logger.record(SchedulerStats(host_kv_cache_hits=96, host_kv_bytes_to_host=4096), None)
    text = generate_latest(logger.registry).decode()
    assert 'xlm:host_kv_cache_usage_perc{engine="0",model_name="m"} 0.0' in text
    assert 'xlm:host_kv_cache_hits_total{engine="0",model_name="m"} 96.0' in text
    assert 'xlm:host_kv_bytes_to_host_total{engine="0",model_name="m"} 4096.0' in text
    assert 'xlm:host_kv_bytes_to_device_total{engine="0",model_name="m"} 1024.0' in text


def test_logging_stat_logger_logs_one_line(caplog):
    logger = LoggingStatLogger()
    tracker = RequestStatsTracker()
    tracker.add("a", 0.0, 4)
    logger.record(
        SchedulerStats(num_running_reqs=1), tracker.update([EngineCoreOutput("a", [1])], 1)
    )
    import logging

    xlm_logger = logging.getLogger("xlm")
    xlm_logger.addHandler(caplog.handler)
    try:
        logger.log()
    finally:
        xlm_logger.removeHandler(caplog.handler)
    assert "Avg generation throughput" in caplog.text and "Running: 1 reqs" in caplog.text


def test_prometheus_logger_exports_speculative_decoding():
    logger = PrometheusStatLogger("m")
    logger.record(
        SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=6),
        None,
    )
    logger.record(
        SchedulerStats(spec_num_drafts=5, spec_num_draft_tokens=16, spec_num_accepted_tokens=8),
        None,
    )
    text = generate_latest(logger.registry).decode()
    assert 'xlm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0' in text
    assert 'xlm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 16.0' in text
    assert 'xlm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 8.0' in text
    assert 'xlm:spec_decode_acceptance_rate{engine="0",model_name="m"} 0.5' in text
    # 1 + 8 accepted over 5 verifications.
    assert 'xlm:spec_decode_mean_accepted_length{engine="0",model_name="m"} 2.6' in text


def test_prometheus_logger_labels_each_data_parallel_engine():
    logger = PrometheusStatLogger("m", engine_indexes=range(2))
    text = generate_latest(logger.registry).decode()
    # Both engines are listed before any step.
    assert 'xlm:num_requests_running{engine="1",model_name="m"} 0.0' in text
    logger.record(SchedulerStats(num_running_reqs=3, prefix_cache_hits=5), None, engine_idx=1)
    logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_hits=2), None, engine_idx=0)
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_hits=9), None, engine_idx=1)
    text = generate_latest(logger.registry).decode()
    assert 'xlm:num_requests_running{engine="0",model_name="m"} 1.0' in text
    assert 'xlm:num_requests_running{engine="1",model_name="m"} 2.0' in text
    # Each engine's cumulative counter advances from its own last total.
    assert 'xlm:prefix_cache_hits_total{engine="0",model_name="m"} 2.0' in text
    assert 'xlm:prefix_cache_hits_total{engine="1",model_name="m"} 9.0' in text
