"""The /v1/responses store: count, age and size bounds evict oldest first."""

from __future__ import annotations

import pytest

from xlm.entrypoints.openai.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, response_id: str, text: str = "x") -> bool:
    item = {"type": "message", "role": "user", "content": text}
    return store.put(response_id, {"id": response_id}, [item])


def test_count_bound_evicts_the_oldest():
    store = ResponseStore(max_entries=3, max_age_s=60, clock=Clock())
    for i in range(5):
        assert _put(store, f"r{i}")
    assert len(store) == 3
    assert store.get("r0") is None and store.get("r1") is None
    kept = store.get("r4")
    assert kept is not None and kept.response == {"id": "r4"}
    assert kept.conversation[0]["role"] == "user"


def test_age_bound_expires_entries():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_age_s=30, clock=clock)
    _put(store, "old")
    clock.now += 20
    _put(store, "new")
    clock.now += 15  # old is 35 s old, new 15 s
    assert store.get("old") is None
    assert store.get("new") is not None
    clock.now += 20
    assert store.get("new") is None and len(store) == 0 and store.num_bytes == 0


def test_size_bound_keeps_the_total_under_max_bytes():
    probe = ResponseStore(clock=Clock())
    _put(probe, "a", "y" * 100)
    one = probe.num_bytes  # the size of one entry as the store counts it
    store = ResponseStore(max_entries=100, max_age_s=60, max_bytes=2 * one + 1, clock=Clock())
    for name in "abc":
        assert _put(store, name, "y" * 100)
    assert [store.get(n) is not None for n in "abc"] == [False, True, True]
    assert store.num_bytes == 2 * one
    assert not _put(store, "huge", "y" * (3 * one))  # larger than the whole store
    assert store.get("huge") is None and store.get("c") is not None


def test_delete_and_zero_entries():
    store = ResponseStore(max_entries=2, max_age_s=60, clock=Clock())
    _put(store, "a")
    assert store.delete("a") and not store.delete("a")
    assert store.num_bytes == 0
    disabled = ResponseStore(max_entries=0, max_age_s=60, clock=Clock())
    assert not _put(disabled, "a") and disabled.get("a") is None


@pytest.mark.parametrize("kwargs", [{"max_entries": -1}, {"max_age_s": 0}, {"max_bytes": -1}])
def test_bad_bounds_are_refused(kwargs):
    with pytest.raises(ValueError, match="response store limits"):
        ResponseStore(**kwargs)
