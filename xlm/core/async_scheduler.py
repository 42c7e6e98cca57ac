"""Async scheduling: step N+1 is scheduled while step N runs.

A step is scheduled before the previous step's tokens are known: each request that
samples in a step is left one placeholder token (``num_output_placeholders``) that the
next step computes, reading the token on the device. Chosen by the engine core when
``SchedulerConfig.async_scheduling`` is on (vLLM keeps its AsyncScheduler apart the same
way).
"""

from __future__ import annotations

from xlm.core.request import Request
from xlm.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """A Scheduler that schedules one step ahead of the sampled tokens."""

    def _on_sampling_scheduled(self, request: Request) -> None:
        request.num_output_placeholders += 1

    def _waits_for_tokens_in_flight(self, request: Request) -> bool:
        """A request whose next step needs its tokens on the host (penalties, bans,
        grammars), or whose tokens in flight surely end it (max_tokens or the length cap),
        waits for them."""
        if request.host_tokens_only:
            return True
        n = request.num_output_placeholders
        max_tokens = request.max_tokens
        return (max_tokens is not None and len(request.output_token_ids) + n >= max_tokens) or (
            len(request.all_token_ids) + n >= self.max_request_len
        )
