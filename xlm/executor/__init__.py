"""Executors run the worker(s): `uni` (this process, all local devices) or `multihost`."""

from __future__ import annotations

from xlm.config import XlmConfig
from xlm.executor.abstract import Executor


def executor_class_for(config: XlmConfig) -> type[Executor]:
    """The executor ParallelConfig.executor_backend names."""
    if config.parallel_config.is_multihost:
        from xlm.executor.multihost import MultihostExecutor

        return MultihostExecutor
    from xlm.executor.uniproc import UniProcExecutor

    return UniProcExecutor
