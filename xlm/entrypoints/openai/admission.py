"""Admission control: a bounded number of sequences in flight; past it, 429.

The engine runs at most `max_num_seqs` sequences at once; the rest wait in its queue.
The server admits a generation request only while the sequences it holds (running plus
waiting, `n` x prompts per request) stay within `max_num_seqs + max_waiting_requests`;
anything past that is refused at once with 429 and `Retry-After`, before tokenization,
so an overload never grows the engine's queue and never disturbs admitted requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from xlm.entrypoints.openai.limits import WAITING_PER_SEQ

# Seconds a refused client is told to wait before retrying.
RETRY_AFTER_S = 1


def default_max_waiting(max_num_seqs: int) -> int:
    """The waiting room when --max-waiting-requests is not given."""
    return WAITING_PER_SEQ * max_num_seqs


def request_cost(request: Any) -> int:
    """Sequences a parsed request puts into the engine: n per prompt (a score or rerank
    request: one per pair)."""
    num_inputs = getattr(request, "num_inputs", None)
    if callable(num_inputs):  # not a client's extra body field of that name
        return max(1, num_inputs())
    n = max(1, int(getattr(request, "n", 1) or 1))
    prompt = getattr(request, "prompt", getattr(request, "input", None))
    prompts = 1
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompts = len(prompt)
    return n * prompts


class AdmissionGate:
    """Counts admitted sequences against a capacity; counts refusals for /metrics."""

    def __init__(self, max_num_seqs: int, max_waiting: int, registry: Any = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.capacity = max_num_seqs + max_waiting
        self.in_flight = 0
        self.rejected = 0
        self._counter = None
        if registry is not None:
            from prometheus_client import Counter

            self._counter = Counter(
                "xlm:num_requests_rejected",
                "Requests refused with 429 because the waiting queue was full.",
                registry=registry,
            )

    def try_acquire(self, cost: int) -> bool:
        """Admit `cost` sequences if they fit.

        When nothing is in flight a request is admitted whatever its cost (n is capped
        separately), so a request larger than the room runs alone rather than never.
        """
        if self.in_flight and self.in_flight + cost > self.capacity:
            self.rejected += 1
            if self._counter is not None:
                self._counter.inc()
            return False
        self.in_flight += cost
        return True

    def release(self, cost: int) -> None:
        """Give back what try_acquire admitted."""
        self.in_flight = max(0, self.in_flight - cost)

    async def guard_stream(self, stream: AsyncIterator[str], cost: int) -> AsyncIterator[str]:
        """Yield a stream's chunks; release the admission when it ends or is closed."""
        try:
            async for chunk in stream:
                yield chunk
        finally:
            self.release(cost)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
