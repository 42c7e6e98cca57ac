"""The local Ray cluster of the Ray tests (127.0.0.1, 2 CPUs), started the same way by
conftest's `ray_cluster` and test_serve's `served`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

# Environment of the driver while the cluster runs: ray.data.read_parquet reads the files'
# footers on a pool of 32 new actors (each a worker process importing Ray Data, started and
# killed per read); one file's footer needs one.
RAY_ENV = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1"}


@contextlib.contextmanager
def local_cluster() -> Iterator[str]:
    """A local Ray cluster for the block; yields its GCS address; shut down (processes too)
    after."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in RAY_ENV.items():
            patch.setenv(name, value)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=128 * 1024**2,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
        # Ray's log monitor (started even with log_to_driver=False) publishes the workers'
        # log lines for drivers to print, and re-lists the log folder every 0.1 s to do so:
        # the busiest Ray process of a test module after the replicas. Here nothing reads
        # what it publishes (the logs still reach their files), so it is stopped.
        ray._private.worker._global_node.kill_log_monitor()
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()
