"""Executors run the worker(s): `uni` (this process, all local devices) or `multihost`."""

from __future__ import annotations

from typing import Any

from xlm.config import XlmConfig


def make_executor(config: XlmConfig) -> Any:
    """The executor ParallelConfig.executor_backend names."""
    if config.parallel_config.is_multihost:
        from xlm.executor.multihost import MultihostExecutor

        return MultihostExecutor(config)
    from xlm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
