"""Waiting queues: arrival order with preempted requests first, or by priority."""

import pytest

from tests.core.sim import make_request
from xlm.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_keeps_arrival_order_and_puts_preempted_first():
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSRequestQueue) and not q and len(q) == 0
    a, b, c = (make_request(i, [1]) for i in "abc")
    for r in (a, b, c):
        q.add_request(r)
    assert q.peek_request() is a and ids(q) == ["a", "b", "c"]
    assert q.pop_request() is a
    q.prepend_request(a)  # preempted: back to the front
    assert ids(q) == ["a", "b", "c"]
    q.remove_requests([b, a])
    assert ids(q) == ["c"] and len(q) == 1 and q


def test_priority_orders_by_priority_then_arrival_then_insertion():
    q = create_request_queue("priority")
    assert isinstance(q, PriorityRequestQueue)
    low = make_request("low", [1], priority=5, arrival_time=1.0)
    late = make_request("late", [1], priority=0, arrival_time=3.0)
    early = make_request("early", [1], priority=0, arrival_time=2.0)
    twin = make_request("twin", [1], priority=0, arrival_time=2.0)
    for r in (low, late, early, twin):
        q.add_request(r)
    assert ids(q) == ["early", "twin", "late", "low"]
    assert q.peek_request() is early and q.pop_request() is early
    q.remove_requests([low])
    assert ids(q) == ["twin", "late"] and len(q) == 2
    # A preempted request is ordered like any other, not put in front.
    q.prepend_request(low)
    assert ids(q) == ["twin", "late", "low"]
    assert [q.pop_request() for _ in range(3)] == [twin, late, low] and not q


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy='lifo' is invalid"):
        create_request_queue("lifo")
