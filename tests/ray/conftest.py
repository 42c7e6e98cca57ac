"""The local Ray cluster the Ray tests share per module."""

from __future__ import annotations

import pytest

from tests.ray.cluster import local_cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module, on 127.0.0.1, shut down (processes too) after."""
    pytest.importorskip("ray.data")
    with local_cluster() as address:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        yield address
