"""Waiting queues: first come first served, or by priority (lower value first)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from xlm.core.request import Request


class FCFSRequestQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        """Queue at the back."""
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        """Queue at the front (preempted requests)."""
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        """The next request to admit."""
        return self._queue[0]

    def pop_request(self) -> Request:
        """Remove and return the next request."""
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove several requests in one pass."""
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest priority value first, then earliest arrival, then earliest added."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def add_request(self, request: Request) -> None:
        """Queue by (priority, arrival_time)."""
        self._seq += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._seq, request))

    # A preempted request is ordered by its priority and arrival like any other.
    prepend_request = add_request

    def peek_request(self) -> Request:
        """The next request to admit."""
        return self._heap[0][3]

    def pop_request(self) -> Request:
        """Remove and return the next request."""
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove several requests in one pass."""
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy={policy!r} is invalid: allowed 'fcfs' or 'priority'")
