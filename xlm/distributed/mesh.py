"""The engine's device mesh (axes `data`, `model`) and moving step data on and off it.

One process drives every local device (`uni`) or, with `jax.distributed`, one process per
host drives its own devices of one global mesh (`multihost`). Step inputs are replicated:
every process builds the same host arrays and places its own devices' copies. Outputs the
host reads (sampled tokens, logprobs) are replicated too, so each process reads its local
copy and no process gathers from another.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from xlm.config import ParallelConfig

MESH_AXES = ("data", "model")
TP_AXIS = "model"  # the tensor-parallel axis: weights' and KV heads' shards


def tp_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh being traced under when it splits the tensor-parallel axis, else None (ops
    whose kernels have no partitioning rule run them per shard, or take their jnp path)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names or mesh.shape[TP_AXIS] == 1:
        return None
    return mesh


def make_mesh(parallel_config: ParallelConfig, devices: list[Any] | None = None) -> Mesh:
    """The (data, model) mesh of one engine: tp devices of `jax.devices()` (all hosts').

    A data-parallel rank's process normally sees only its own device group (its platform
    restricts the visible devices, `Platform.data_parallel_env`); where it sees every
    rank's devices, it takes its group, devices [rank * tp, (rank + 1) * tp)."""
    tp = parallel_config.tensor_parallel_size
    devices = rank_devices(
        list(jax.devices() if devices is None else devices),
        tp,
        parallel_config.data_parallel_size,
        parallel_config.data_parallel_rank,
    )
    if tp > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} device(s) "
            f"found ({devices[0].platform})"
        )
    if jax.process_count() > 1 and tp != len(devices):
        raise ValueError(
            f"tensor_parallel_size={tp} must equal the {len(devices)} devices of the "
            f"{jax.process_count()} processes: every host takes part in the one model"
        )
    # Data parallelism runs across engines, so each engine's `data` axis has size 1.
    grid = _device_grid(devices[:tp], (1, tp))
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def rank_devices(devices: list[Any], tp: int, dp: int, rank: int) -> list[Any]:
    """A data-parallel rank's device group: all devices when they are only its own (fewer
    than dp * tp visible), else devices [rank * tp, (rank + 1) * tp)."""
    if dp > 1 and len(devices) >= dp * tp:
        return devices[rank * tp : (rank + 1) * tp]
    return devices


def _device_grid(devices: list[Any], shape: tuple[int, int]) -> np.ndarray:
    # On TPU, mesh_utils orders chips so that `model` neighbours are ICI neighbours.
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return np.asarray(devices, dtype=object).reshape(shape)


def describe_mesh(mesh: Mesh | None) -> str:
    """One line: axis sizes, device kind, processes."""
    if mesh is None:
        device = jax.devices()[0]
        return f"no mesh (one device: {device.device_kind})"
    sizes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    device = mesh.devices.flat[0]
    processes = len({d.process_index for d in mesh.devices.flat})
    count = mesh.devices.size
    return f"mesh ({sizes}) of {count} {device.device_kind} device(s), {processes} process(es)"


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def replicated_shape(shape: tuple[int, ...], dtype: Any, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype and sharding (replicated over `mesh`), for lowering with."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else replicated(mesh))


def put_replicated(value: np.ndarray, mesh: Mesh | None) -> jax.Array:
    """A host array on every device of the mesh (each process places its own copies)."""
    if mesh is None:
        return jax.device_put(value)
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, replicated(mesh), lambda index: value[index])


def to_host(tree: Any) -> Any:
    """Host copies of (replicated) device arrays; reads only this process's devices. Every
    array's copy starts before the first is waited for."""

    def local(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x.addressable_data(0)
        return x

    tree = jax.tree_util.tree_map(local, tree)
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            x.copy_to_host_async()
    return jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def per_device_bytes(tree: Any, elements: bool = False) -> dict[Any, int]:
    """Bytes each device of the mesh holds of the arrays or sharded ShapeDtypeStructs in
    `tree` (a compile target's weights and caches are the latter: no data, only shardings).
    `elements`: count elements instead (weights of mixed element types: quantized)."""
    total: dict[Any, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        itemsize = 1 if elements else np.dtype(leaf.dtype).itemsize
        for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
            shape = [len(range(*s.indices(n))) for s, n in zip(index, leaf.shape)]
            total[device] = total.get(device, 0) + int(np.prod(shape)) * itemsize
    return total
