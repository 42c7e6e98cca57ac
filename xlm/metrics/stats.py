"""Per-iteration and per-request statistics the front end gathers for stat loggers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class FinishedRequestStats:
    """Timings and counts of one finished engine-core request."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    mean_time_per_output_token: float | None
    queue_time: float | None = None


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine-core outputs added: tokens, latencies, finished requests."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    # Admission to first schedule, in the engine, of requests scheduled this step.
    queue_times: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)
class RequestTiming:
    """Running timestamps of one engine-core request (time.monotonic clock)."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Turns engine-core outputs into IterationStats, per core request id."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestTiming] = {}

    def add(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        """Start timing a request sent to the core."""
        self.requests[request_id] = RequestTiming(arrival, num_prompt_tokens)

    def remove(self, request_id: str) -> None:
        """Forget a request (aborted by the front end)."""
        self.requests.pop(request_id, None)

    def finish(self, request_id: str, reason: str, now: float) -> FinishedRequestStats | None:
        """End a request the front end finished (a stop string matched)."""
        timing = self.requests.pop(request_id, None)
        return None if timing is None else _finished(timing, reason, now)

    def update(self, outputs: list[Any], now: float) -> IterationStats:
        """Account the EngineCoreOutputs of one step."""
        stats = IterationStats()
        requests = self.requests
        for output in outputs:
            timing = requests.get(output.request_id)
            if timing is None:
                continue
            num_new = len(output.new_token_ids)
            if num_new:
                if timing.first_token is None:
                    timing.first_token = now
                    stats.num_prompt_tokens += timing.num_prompt_tokens
                    stats.num_cached_prompt_tokens += max(output.num_cached_tokens or 0, 0)
                    stats.time_to_first_tokens.append(now - timing.arrival)
                else:
                    stats.inter_token_latencies.append((now - timing.last_token) / num_new)
                timing.last_token = now
                timing.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if output.finish_reason is not None:
                del requests[output.request_id]
                stats.finished_requests.append(_finished(timing, output.finish_reason, now))
        return stats


def _finished(timing: RequestTiming, finish_reason: str, now: float) -> FinishedRequestStats:
    ttft = None if timing.first_token is None else timing.first_token - timing.arrival
    tpot = None
    if timing.first_token is not None and timing.num_generation_tokens > 1:
        tpot = (timing.last_token - timing.first_token) / (timing.num_generation_tokens - 1)
    return FinishedRequestStats(
        finish_reason=finish_reason,
        e2e_latency=now - timing.arrival,
        num_prompt_tokens=timing.num_prompt_tokens,
        num_generation_tokens=timing.num_generation_tokens,
        time_to_first_token=ttft,
        mean_time_per_output_token=tpot,
    )
