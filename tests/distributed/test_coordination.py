"""Meeting points of a multihost engine's processes, over a stand-in for JAX's coordination
client (tests/e2e/test_multihost_runs.py runs the real one across processes)."""

from __future__ import annotations

import jax
import pytest
from jax._src import distributed

from xlm.distributed import coordination


class FakeClient:
    """A key-value store and barrier recorder with JAX's client's method names."""

    def __init__(self, store: dict[str, str]) -> None:
        self.store = store
        self.barriers: list[tuple[str, int]] = []

    def key_value_set(self, key: str, value: str) -> None:
        self.store[key] = value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        return self.store[key]

    def wait_at_barrier(self, name: str, timeout_ms: int) -> None:
        self.barriers.append((name, timeout_ms))


@pytest.fixture
def client(monkeypatch):
    fake = FakeClient({"xlm/blocks/0": "40", "xlm/blocks/2": "35"})
    monkeypatch.setattr(distributed.global_state, "client", fake)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    return fake


def test_agree_min_publishes_this_process_and_takes_the_smallest(client):
    assert coordination.agree_min("blocks", 38) == 35
    assert client.store["xlm/blocks/1"] == "38"
    assert coordination.agree_min("blocks", 30) == 30


def test_barrier_names_are_namespaced(client):
    coordination.barrier("weights")
    assert client.barriers == [("xlm/weights", coordination.READY_TIMEOUT_MS)]


def test_one_process_agrees_with_itself_without_a_client(monkeypatch):
    monkeypatch.setattr(distributed.global_state, "client", None)
    assert coordination.agree_min("blocks", 7) == 7
