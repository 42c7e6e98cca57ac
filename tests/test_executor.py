"""Which executor a config gets: this process's for "uni", the multihost one otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from xlm.config import ParallelConfig
from xlm.executor import executor_class_for
from xlm.executor.multihost import MultihostExecutor
from xlm.executor.uniproc import UniProcExecutor


def test_executor_follows_the_backend():
    uni = SimpleNamespace(parallel_config=ParallelConfig())
    assert executor_class_for(uni) is UniProcExecutor
    multihost = ParallelConfig(
        executor_backend="multihost",
        coordinator_address="127.0.0.1:1234",
        num_processes=2,
        process_id=0,
    )
    assert executor_class_for(SimpleNamespace(parallel_config=multihost)) is MultihostExecutor
