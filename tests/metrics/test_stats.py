"""Front-end request statistics: first-token, inter-token and end-to-end times per request."""

from __future__ import annotations

from xlm.core.outputs import EngineCoreOutput
from xlm.metrics.stats import RequestStatsTracker


def test_tracker_times_first_token_inter_token_and_finish():
    tracker = RequestStatsTracker()
    tracker.add("a", arrival=10.0, num_prompt_tokens=5)
    tracker.add("b", arrival=10.0, num_prompt_tokens=3)
    first = tracker.update([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [])], now=10.5)
    assert first.time_to_first_tokens == [0.5] and first.num_prompt_tokens == 5
    second = tracker.update([EngineCoreOutput("a", [2, 3], "length")], now=11.5)
    assert second.inter_token_latencies == [0.5] and second.num_generation_tokens == 2
    (done,) = second.finished_requests
    assert done.finish_reason == "length" and done.e2e_latency == 1.5
    assert done.num_generation_tokens == 3 and done.mean_time_per_output_token == 0.5
    stopped = tracker.finish("b", "stop", now=12.0)
    assert stopped.finish_reason == "stop" and stopped.time_to_first_token is None
    assert tracker.requests == {}
