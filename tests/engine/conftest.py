"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.engine.fake_core import FakeEngineCoreProc
from xlm.engine.core_client import make_client


@pytest.fixture
def sync_client():
    """A SyncMPClient over a FakeEngineCoreProc in its own process."""
    client = make_client(
        {}, multiprocess=True, asyncio_mode=False, engine_core_proc_class=FakeEngineCoreProc
    )
    yield client
    client.shutdown()
