"""The host KV tier's memory: this process's shards of evicted blocks, and the copies.

The scheduler's index (xlm.core.host_kv_tier) decides each step which device blocks go out
to which host slots and which slots come back into which blocks (HostKVTransfers in the
SchedulerOutput); every process of the engine runs the same copies on its own shards, so
the multi-host engine needs nothing more than the step it already broadcasts.

Host memory: per cache array, one numpy buffer per distinct shard this process holds
(tensor parallelism shards the cache over KV heads: each device's shard; a replicated
cache is kept once), slot-major so one block's bytes are contiguous. Copies go in chunks
of a few fixed sizes, compiled ahead of time at warm-up: a gather of the blocks to save
(read before the step's forward, which may overwrite them), fetched to the host on a
background thread so the step is not blocked, and a donated scatter of the loaded blocks
into the cache. A load first waits for the saves still in flight.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlm.core.host_kv_tier import HostKVTransfers
from xlm.distributed.mesh import put_replicated

# Blocks per copy program (a step's copies go in chunks of the largest, the rest padded).
COPY_SIZES = (4, 16, 64)
# A cache's block axis (every attention layout keeps (2, num_blocks, ...)); never sharded.
BLOCK_AXIS = 1


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[Any, Any], ...]:
    """A shard's place in the global array, hashable and blind to the block axis's size."""
    return tuple(
        (None, None) if d == BLOCK_AXIS else (s.start, s.stop) for d, s in enumerate(index)
    )


def _shards(spec: Any) -> dict[tuple, tuple[int, ...]]:
    """Distinct shards this process holds of one cache array: key -> shard shape."""
    sharding = getattr(spec, "sharding", None)
    shape = tuple(spec.shape)
    if sharding is None:
        return {_index_key(tuple(slice(None) for _ in shape)): shape}
    shard_shape = tuple(sharding.shard_shape(shape))
    keys = {_index_key(i) for i in sharding.addressable_devices_indices_map(shape).values()}
    return {k: shard_shape for k in keys}


def host_block_bytes(kv_spec: list[Any]) -> int:
    """Host bytes of one block over this process's distinct shards of every cache array."""
    total = 0
    for spec in kv_spec:
        itemsize = jnp.dtype(spec.dtype).itemsize
        for shape in _shards(spec).values():
            total += int(np.prod(shape)) // shape[BLOCK_AXIS] * itemsize
    return total


class HostKVCache:
    """Host buffers of `num_slots` blocks and the device<->host block copies."""

    def __init__(self, kv_spec: list[Any], num_slots: int, num_blocks: int, mesh: Any) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self._mesh = mesh
        self._specs = kv_spec
        # Per array: shard key -> buffer [num_slots, 2, ...shard without the block axis].
        self._buffers: list[dict[tuple, np.ndarray]] = []
        for spec in kv_spec:
            dtype = np.dtype(spec.dtype)
            buffers = {}
            for key, shape in _shards(spec).items():
                rest = shape[:BLOCK_AXIS] + shape[BLOCK_AXIS + 1 :]
                buffers[key] = np.empty((num_slots, *rest), dtype)
            self._buffers.append(buffers)
        self.nbytes = sum(b.nbytes for buffers in self._buffers for b in buffers.values())
        self._gathers: dict[int, Any] = {}
        self._scatters: dict[int, Any] = {}
        self.num_compilations = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xlm-host-kv")
        self._last_save: Future | None = None

    def _sharding(self, spec: Any) -> Any:
        sharding = getattr(spec, "sharding", None)
        return (
            sharding
            if sharding is not None
            else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )

    def _chunk_spec(self, spec: Any, n: int) -> jax.ShapeDtypeStruct:
        shape = list(spec.shape)
        shape[BLOCK_AXIS] = n
        return jax.ShapeDtypeStruct(tuple(shape), spec.dtype, sharding=self._sharding(spec))

    def compile(self) -> None:
        """Compile the gather and scatter of every copy size (warm-up: none later)."""
        for n in COPY_SIZES:
            if n in self._gathers:
                continue
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._ids_sharding())
            caches = [self._chunk_spec(s, self.num_blocks) for s in self._specs]
            chunks = [self._chunk_spec(s, n) for s in self._specs]
            cache_shardings = [c.sharding for c in caches]
            chunk_shardings = [c.sharding for c in chunks]
            self._gathers[n] = (
                jax.jit(_gather, out_shardings=chunk_shardings).lower(caches, ids).compile()
            )
            self._scatters[n] = (
                jax.jit(_scatter, donate_argnums=0, out_shardings=cache_shardings)
                .lower(caches, ids, chunks)
                .compile()
            )
            self.num_compilations += 2

    def _ids_sharding(self) -> Any:
        if self._mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

    def apply(self, caches: list[Any], transfers: HostKVTransfers) -> list[Any]:
        """Run one step's copies: saves (out of the blocks as they are now), then loads;
        returns the cache arrays (the loads donate and replace them)."""
        if transfers.save_slots:
            self._save(caches, transfers.save_block_ids, transfers.save_slots)
        if transfers.load_slots:
            caches = self._load(caches, transfers.load_slots, transfers.load_block_ids)
        return caches

    def _chunks(self, a: list[int], b: list[int]):
        """(size, a chunk, b chunk) pieces of at most the largest copy size."""
        top = COPY_SIZES[-1]
        for i in range(0, len(a), top):
            ca, cb = a[i : i + top], b[i : i + top]
            yield next(n for n in COPY_SIZES if n >= len(ca)), ca, cb

    def _save(self, caches: list[Any], block_ids: list[int], slots: list[int]) -> None:
        for n, ids, chunk_slots in self._chunks(block_ids, slots):
            padded = np.zeros(n, np.int32)  # pads read block 0 (the null block); dropped
            padded[: len(ids)] = ids
            gathered = self._gathers[n](caches, put_replicated(padded, self._mesh))
            for array in gathered:
                array.copy_to_host_async()
            self._last_save = self._writer.submit(self._write, gathered, chunk_slots)

    def _write(self, gathered: list[Any], slots: list[int]) -> None:
        """(Writer thread) the gathered blocks' shards into their host slots."""
        k = len(slots)
        for array, buffers in zip(gathered, self._buffers):
            for shard in array.addressable_shards:
                key = _index_key(shard.index)
                if key in buffers:
                    data = np.asarray(shard.data)
                    buffers[key][slots] = np.moveaxis(data, BLOCK_AXIS, 0)[:k]

    def wait(self) -> None:
        """Wait for the saves in flight (their host slots are written after)."""
        if self._last_save is not None:
            self._last_save.result()
            self._last_save = None

    def _load(self, caches: list[Any], slots: list[int], block_ids: list[int]) -> list[Any]:
        self.wait()
        for n, chunk_slots, ids in self._chunks(slots, block_ids):
            padded = np.full(n, self.num_blocks, np.int32)  # out of range: dropped
            padded[: len(ids)] = ids
            chunks = [
                self._host_chunk(spec, buffers, chunk_slots, n)
                for spec, buffers in zip(self._specs, self._buffers)
            ]
            caches = self._scatters[n](caches, put_replicated(padded, self._mesh), chunks)
        return caches

    def _host_chunk(
        self, spec: Any, buffers: dict[tuple, np.ndarray], slots: list[int], n: int
    ) -> jax.Array:
        """One array's blocks of `slots` (padded to n) as a device array sharded like it."""
        data = {}
        for key, buf in buffers.items():
            block = np.zeros((n, *buf.shape[1:]), buf.dtype)
            block[: len(slots)] = buf[slots]
            data[key] = np.moveaxis(block, 0, BLOCK_AXIS)
        chunk = self._chunk_spec(spec, n)
        return jax.make_array_from_callback(
            chunk.shape, chunk.sharding, lambda index: data[_index_key(index)]
        )

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)


def _gather(caches: list[jax.Array], ids: jax.Array) -> list[jax.Array]:
    return [jnp.take(c, ids, axis=BLOCK_AXIS) for c in caches]


def _scatter(caches: list[jax.Array], ids: jax.Array, chunks: list[jax.Array]) -> list[jax.Array]:
    return [c.at[:, ids].set(x, mode="drop") for c, x in zip(caches, chunks)]
