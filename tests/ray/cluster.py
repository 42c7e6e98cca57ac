"""The local Ray cluster of the Ray tests (127.0.0.1, 2 CPUs), started the same way by
conftest's `ray_cluster` and test_serve's `served`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

# Ray's log monitor (started even with log_to_driver=False) re-lists the session's log
# folder on every 0.1 s pass while it holds fewer than 1000 files, about 5% of a core
# through a test module; this lists it every 5 s instead (the logs still reach their files).
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}

# Ray kills a worker process idle for 1 s beyond the first `num_cpus` workers, so each job
# of a module started (and imported ray.data into) a new process for its read, split and
# parse tasks: kept, the next job's tasks reuse them.
SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 600_000, "num_workers_soft_limit": 8}


@contextlib.contextmanager
def local_cluster() -> Iterator[str]:
    """A local Ray cluster for the block; yields its GCS address; shut down (processes too)
    after."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LOG_MONITOR_ENV.items():
            patch.setenv(name, value)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=128 * 1024**2,
            _node_ip_address="127.0.0.1",
            _system_config=SYSTEM_CONFIG,
            log_to_driver=False,
        )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
