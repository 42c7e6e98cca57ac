"""The local Ray cluster the Ray tests share per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module, on 127.0.0.1, shut down (processes too) after."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 1024**2,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
