"""Sleep mode and weight updates: a runner's device arrays dropped, kept on the host, or
replaced, without recompiling anything.

Why nothing recompiles: every step program takes the weights and the KV cache as
arguments and was compiled for their shapes, dtypes and shardings. Waking up puts back
arrays of the same shapes, dtypes and shardings (from the host copy, or read again from
the checkpoint), and a weight update swaps in arrays checked to match, so the programs
already compiled run them.

The runner's Variables are updated in place (`set_value`): the programs' example
arguments and the LoRA slots (xlm.lora.slots) hold the same Variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlm.worker.kv_allocation import KVCacheAllocation

# Adapter slots are runtime state, not checkpoint tensors: sleep keeps them on the host at
# every level, and a weight update leaves them as they are.
RUNTIME_LEAVES = ("lora_a", "lora_b")


def flat_variables(state: nnx.State) -> dict[str, nnx.Variable]:
    """The state's Variables by dotted path ("layers.0.attn.q_proj.kernel")."""
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


def is_runtime(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in RUNTIME_LEAVES


def device_bytes(array: Any) -> int:
    """Bytes an array holds on this process's devices (every replica counted)."""
    if not isinstance(array, jax.Array) or array.is_deleted():
        return 0
    return sum(shard.data.nbytes for shard in array.addressable_shards)


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


@dataclass
class HostCopy:
    """One array's shards in host memory (each distinct shard once) and where they go."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    data: dict[tuple, np.ndarray] = field(default_factory=dict)
    placements: list[tuple[Any, tuple]] = field(default_factory=list)

    @classmethod
    def of(cls, array: jax.Array) -> HostCopy:
        copy = cls(array.shape, array.dtype, array.sharding)
        for shard in array.addressable_shards:
            key = _index_key(shard.index)
            if key not in copy.data:
                # A copy, not a view: the device buffer is deleted next (on CPU a view
                # would share it).
                copy.data[key] = np.array(shard.data, copy=True)
            copy.placements.append((shard.device, key))
        return copy

    def to_device(self) -> jax.Array:
        """The array again, with the same sharding (so the compiled programs take it)."""
        shards = [jax.device_put(self.data[key], device) for device, key in self.placements]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, shards)


@dataclass
class SleepRecord:
    """What a sleeping runner needs to wake: its level, the host copies (every weight at
    level 1, only the runtime leaves at level 2) and the bytes it freed."""

    level: int
    host: dict[str, HostCopy]
    freed_weight_bytes: int
    freed_kv_bytes: int


def drop_weights(state: nnx.State, level: int) -> tuple[dict[str, HostCopy], int]:
    """Delete the state's device arrays (level 1: copied to the host first; level 2: only
    the runtime leaves are); the host copies and the device bytes freed."""
    host: dict[str, HostCopy] = {}
    first: dict[int, str] = {}  # an array two Variables share (tied weights) goes once
    freed = 0
    for name, var in flat_variables(state).items():
        value = var.get_value()
        if not isinstance(value, jax.Array):
            continue
        if id(value) in first:
            if first[id(value)] in host:
                host[name] = host[first[id(value)]]
            continue
        first[id(value)] = name
        if level == 1 or is_runtime(name):
            host[name] = HostCopy.of(value)
        freed += device_bytes(value)
        value.delete()
    return host, freed


def restore_weights(state: nnx.State, host: dict[str, HostCopy], fresh: nnx.State | None) -> None:
    """Put the weights back: from the host copies, the rest from `fresh` (a model's state
    read again from its checkpoint: level 2), placed as the old arrays were."""
    variables = flat_variables(state)
    new = {} if fresh is None else flat_variables(fresh)
    restored: dict[int, jax.Array] = {}  # by host copy: a shared array comes back shared
    for name, var in variables.items():
        old = var.get_value()
        if name in host:
            copy = host[name]
            if id(copy) not in restored:
                restored[id(copy)] = copy.to_device()
            var.set_value(restored[id(copy)])
        elif isinstance(old, jax.Array):
            value = new[name].get_value()
            var.set_value(_placed_like(value, old))


def _placed_like(value: jax.Array, old: jax.Array) -> jax.Array:
    """`value` with `old`'s sharding (a program compiled for it takes it as it is)."""
    if value.sharding == old.sharding:
        return value
    return jax.device_put(value, old.sharding)


def check_weights(state: nnx.State, fresh: nnx.State, source: str) -> None:
    """Raise ValueError naming the first tensor of `fresh` whose shape or dtype differs
    from the engine's (or that one side lacks); runtime leaves are not compared."""
    old = {n: v for n, v in flat_variables(state).items() if not is_runtime(n)}
    new = {n: v for n, v in flat_variables(fresh).items() if not is_runtime(n)}
    missing = sorted(set(old) - set(new))
    if missing:
        raise ValueError(
            f"update_weights: the checkpoint {source!r} has no tensor for {missing[0]} "
            f"({len(missing)} missing); nothing was changed"
        )
    extra = sorted(set(new) - set(old))
    if extra:
        raise ValueError(
            f"update_weights: the checkpoint {source!r} has a tensor {extra[0]} the engine's "
            f"model lacks ({len(extra)} extra); nothing was changed"
        )
    for name, var in old.items():
        a, b = var.get_value(), new[name].get_value()
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise ValueError(
                f"update_weights: tensor {name} is {tuple(b.shape)} {b.dtype} in {source!r}, "
                f"the engine's is {tuple(a.shape)} {a.dtype}; the shapes and dtypes must "
                "match (nothing was changed)"
            )


def swap_weights(state: nnx.State, fresh: nnx.State) -> None:
    """Replace every checkpoint tensor of `state` with `fresh`'s (checked beforehand)."""
    new = flat_variables(fresh)
    for name, var in flat_variables(state).items():
        if is_runtime(name):
            continue
        old = var.get_value()
        # The old array is not deleted: a step still in flight may read it; it goes with
        # its last reference.
        var.set_value(_placed_like(new[name].get_value(), old))


class RunnerSleep:
    """A runner's sleep state: its weights (`state`) and KV cache dropped, kept on the
    host or put back, and its weights swapped for a checkpoint's."""

    def __init__(self, state: nnx.State, kv_cache: KVCacheAllocation) -> None:
        self.state = state
        self.kv_cache = kv_cache
        self.record: SleepRecord | None = None  # asleep: what wake_up needs

    @property
    def level(self) -> int | None:
        """The level the runner sleeps at, or None when awake."""
        return None if self.record is None else self.record.level

    def device_bytes(self) -> tuple[int, int]:
        """(weights, KV cache) bytes the runner holds on this process's devices now."""
        arrays = {id(v.get_value()): v.get_value() for v in flat_variables(self.state).values()}
        weights = sum(device_bytes(a) for a in arrays.values())  # a shared array once
        kv = 0 if self.record is not None else sum(device_bytes(a) for a in self.kv_cache.arrays)
        return weights, kv

    def sleep(self, level: int) -> SleepRecord:
        """Free the weights (level 1: kept in host memory) and the KV cache."""
        host, freed_weights = drop_weights(self.state, level)
        caches = self.kv_cache.arrays
        freed_kv = sum(device_bytes(a) for a in caches)
        for array in caches:
            array.delete()
        self.kv_cache.arrays = []
        self.record = SleepRecord(level, host, freed_weights, freed_kv)
        return self.record

    def wake_up(self, fresh: nnx.State | None = None) -> None:
        """Put the weights back (level 2: `fresh`, the checkpoint read again) and a zeroed
        KV cache, each as it was placed: the compiled programs take them."""
        record, self.record = self.record, None
        restore_weights(self.state, record.host, fresh)
        self.kv_cache.allocate()

    def update_weights(self, fresh: nnx.State, source: str) -> None:
        """Take `fresh`'s tensors as the weights; ValueError (nothing changed) when a
        tensor's shape or dtype differs."""
        check_weights(self.state, fresh, source)
        swap_weights(self.state, fresh)
