"""The KV cache's arrays are zeroed on a thread: the first read returns zeros of the spec's
shapes and dtypes; a compile target keeps the specs; an assignment replaces the arrays;
an allocation that fails raises where the arrays are first read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlm.worker.kv_allocation import KVCacheAllocation


def _spec(shapes, dtype=jnp.float32):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes]


def test_first_read_returns_zeros_of_the_spec():
    spec = _spec([(2, 4, 8), (3, 5)], jnp.bfloat16)
    arrays = KVCacheAllocation(spec).arrays
    assert [a.shape for a in arrays] == [(2, 4, 8), (3, 5)]
    assert all(a.dtype == jnp.bfloat16 for a in arrays)
    assert all(isinstance(a, jax.Array) and not np.asarray(a, np.float32).any() for a in arrays)


def test_reads_return_the_same_arrays():
    allocation = KVCacheAllocation(_spec([(4, 4)]))
    first = allocation.arrays
    assert allocation.arrays is first


def test_without_allocating_the_specs_are_kept():
    spec = _spec([(4, 4)])
    assert KVCacheAllocation(spec, allocate=False).arrays is spec


def test_assignment_replaces_the_arrays_even_while_pending():
    allocation = KVCacheAllocation(_spec([(4, 4)]))
    new = [jnp.ones((4, 4))]
    allocation.arrays = new
    assert allocation.arrays is new


def test_a_failed_allocation_raises_on_first_read():
    bad = [jax.ShapeDtypeStruct((-1, 4), jnp.float32)]  # jnp.zeros refuses a negative dim
    allocation = KVCacheAllocation(bad)
    with pytest.raises(TypeError, match="nonnegative"):
        _ = allocation.arrays
