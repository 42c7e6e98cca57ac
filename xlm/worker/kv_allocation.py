"""The KV cache's zeroed arrays, allocated on a thread while start-up goes on."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp


def _allocate(spec: list[jax.ShapeDtypeStruct], result: Future) -> None:
    """Zeroed arrays of `spec` into `result` (run on a thread)."""
    try:
        result.set_result([jnp.zeros(s.shape, s.dtype, device=s.sharding) for s in spec])
    except BaseException as e:  # out of memory: raised where the cache is first read
        result.set_exception(e)


class KVCacheAllocation:
    """The cache's arrays: zeroed on a thread, overlapping what start-up does next
    (writing 1 GiB of zeros takes ~0.4 s on CPU); the first read waits for them."""

    def __init__(self, spec: list[jax.ShapeDtypeStruct], allocate: bool = True) -> None:
        self.spec = spec
        self._arrays: list[Any] = spec  # a compile target's runner keeps the specs
        self._pending: Future | None = None
        if allocate:
            self.allocate()

    def allocate(self) -> None:
        """Zeroed arrays of the spec, on a thread (at start-up, and on waking up)."""
        self._pending = Future()
        threading.Thread(target=_allocate, args=(self.spec, self._pending), daemon=True).start()

    @property
    def arrays(self) -> list[Any]:
        if self._pending is not None:
            self._arrays = self._pending.result()
            self._pending = None
        return self._arrays

    @arrays.setter
    def arrays(self, value: list[Any]) -> None:
        self._pending = None
        self._arrays = value
