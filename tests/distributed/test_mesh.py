"""The device mesh: checks of the sizes asked for, replicated placement and its host copy,
the bytes each device holds (one CPU device here; tests/distributed/test_tensor_parallel.py
runs four)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from xlm.config import ParallelConfig
from xlm.distributed.mesh import (
    describe_mesh,
    make_mesh,
    per_device_bytes,
    put_replicated,
    rank_devices,
    to_host,
    tp_mesh,
)


def test_sizes_are_checked_against_the_devices():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices; 1 device"):
        make_mesh(ParallelConfig(tensor_parallel_size=2), jax.devices()[:1])
    # A data-parallel rank's engine is one TP group: its mesh's data axis stays 1.
    mesh = make_mesh(ParallelConfig(data_parallel_size=2, data_parallel_rank=1), jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "model": 1}


def test_a_data_parallel_rank_takes_its_device_group():
    devices = list(range(8))
    assert rank_devices(devices, tp=2, dp=2, rank=0) == [0, 1]
    assert rank_devices(devices, tp=2, dp=2, rank=1) == [2, 3]
    assert rank_devices(devices, tp=2, dp=4, rank=3) == [6, 7]
    # A rank process that sees only its own group (the platform restricted it) uses it all.
    assert rank_devices([5, 6], tp=2, dp=2, rank=1) == [5, 6]
    assert rank_devices(devices, tp=2, dp=1, rank=0) == devices


def test_one_device_mesh_places_and_fetches():
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert describe_mesh(mesh).startswith("mesh (data=1, model=1) of 1 ")
    assert describe_mesh(mesh).endswith("device(s), 1 process(es)")
    assert describe_mesh(None).startswith("no mesh (one device: ")
    value = np.arange(6, dtype=np.int32).reshape(2, 3)
    placed = put_replicated(value, mesh)
    assert placed.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec()), 2)
    host = to_host({"x": placed, "n": 3})
    assert host["n"] == 3 and isinstance(host["x"], np.ndarray)
    np.testing.assert_array_equal(host["x"], value)
    assert tp_mesh() is None  # not tracing under a tensor-parallel mesh


def test_per_device_bytes_counts_arrays_and_shape_structs():
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    sharding = NamedSharding(mesh, PartitionSpec())
    tree = {
        "w": jax.ShapeDtypeStruct((4, 8), jnp.bfloat16, sharding=sharding),
        "b": put_replicated(np.zeros(5, np.float32), mesh),
        "host": np.zeros(100),  # no sharding: not on a device
    }
    (device,) = mesh.devices.flat
    assert per_device_bytes(tree) == {device: 4 * 8 * 2 + 5 * 4}
    assert per_device_bytes(tree, elements=True) == {device: 32 + 5}
