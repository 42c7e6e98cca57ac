"""The `dummy` load format: deterministic random weights for any config."""

from __future__ import annotations

import functools
import math
import os
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Values drawn per seed; every matrix reads them cyclically from its own offset, since
# slicing one pool runs at memory speed where drawing every matrix afresh does not (RESULTS.md,
# "Start-up"). Dummy weights only need to be
# deterministic, distinct per parameter and of the right scale.
_POOL_SIZE = 1 << 22


@functools.lru_cache(maxsize=4)
def _pool(seed: int) -> np.ndarray:
    """Unit-variance values (uniform on [-sqrt(3), sqrt(3)]) for `seed`, twice over so that
    any window of _POOL_SIZE values is one contiguous slice."""
    values = np.random.default_rng(seed).uniform(-math.sqrt(3), math.sqrt(3), _POOL_SIZE)
    return np.tile(values.astype(np.float32), 2)


def dummy_value(path: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A float32 value for parameter `path`, scaled so activations stay finite."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf == "bias":
        return np.zeros(shape, np.float32)
    if len(shape) == 1:  # norm weights
        return np.ones(shape, np.float32)
    # Embedding tables are [vocab, hidden]; kernels are [..., in, out].
    fan_in = shape[-1] if leaf == "weight" else shape[-2]
    start = zlib.crc32(path.encode()) % _POOL_SIZE
    window = _pool(seed)[start : start + _POOL_SIZE]
    out = np.resize(window, math.prod(shape)).reshape(shape)
    out *= np.float32(fan_in**-0.5)
    return out


def dummy_values(
    params: Iterable[tuple[str, tuple[int, ...]]], seed: int
) -> Iterator[tuple[str, np.ndarray]]:
    """`dummy_value` of each (path, shape), in order, drawn on a thread per core a few
    parameters ahead (numpy fills without the GIL): one thread took 21.5 s to draw an 8B
    model's 32 GB of float32 on an H200's host. At most one value per thread waits."""
    workers = os.cpu_count() or 1
    _pool(seed)  # drawn once, before the threads share it
    params = iter(params)
    with ThreadPoolExecutor(workers, thread_name_prefix="xlm-dummy") as pool:
        pending: deque = deque()

        def submit() -> None:
            item = next(params, None)
            if item is not None:
                pending.append((item[0], pool.submit(dummy_value, *item, seed)))

        for _ in range(workers):
            submit()
        while pending:
            path, value = pending.popleft()
            submit()
            yield path, value.result()
