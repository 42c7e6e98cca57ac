"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.engine.fake_core import FakeEngineCoreProc
from xlm.engine.mp_client import SyncMPClient


@pytest.fixture
def sync_client():
    """A SyncMPClient over a FakeEngineCoreProc in its own process."""
    client = SyncMPClient({}, True, FakeEngineCoreProc)
    yield client
    client.shutdown()
