"""Placing checkpoint tensors on the devices: each parameter in its stored dtype and
sharding, packed parameters assembled piece by piece, float kernels of quantized
projections quantized on the way, host copies overlapped with reading the next tensor."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlm.distributed.tensor_parallel import logical_shape, to_physical
from xlm.logger import init_logger
from xlm.quantization import get_scheme, q8_kernel_strips, q8_scale_strips, quantize

logger = init_logger(__name__)


HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

# XLA:CPU takes a host array aligned to this many bytes as the device buffer itself
# (jax.device_put aliases it) where an unaligned one is copied again: 256 MB of float32
# ~0.3 s copied, ~1 ms aliased, on this repo's 2-core machine.
HOST_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized host array whose data starts on a HOST_ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def sharding_for(var: nnx.Variable, shape: tuple[int, ...], mesh: Mesh | None) -> Any:
    if mesh is None:
        return None
    names = list(var.get_metadata().get("out_sharding") or (None,) * len(shape))
    for i, name in enumerate(names):
        if name is not None and shape[i] % mesh.shape[name]:
            logger.warning(
                "Dimension %d (%d) is not divisible by mesh axis %r (%d): replicating it.",
                i,
                shape[i],
                name,
                mesh.shape[name],
            )
            names[i] = None
    return NamedSharding(mesh, PartitionSpec(*names))


class WeightPlacer:
    """Places parameter values on device, assembling packed parameters piece by piece."""

    def __init__(self, variables: dict[str, nnx.Variable], dtype: Any, mesh: Mesh | None):
        self.variables = variables
        # Checkpoint-layout shapes; `_put` turns a value into the stored layout.
        self.shapes = {p: checkpoint_shape(v) for p, v in variables.items()}
        self.np_dtype = np.dtype(dtype)
        self.mesh = mesh
        self._placed: dict[str, jax.Array | Future] = {}
        self._pending: dict[str, tuple[np.ndarray, int]] = {}
        # Host copies (out of a memory map, often transposed) run on a thread per core
        # while the next tensor is read: numpy copies without the GIL. A few in flight at
        # most, so that host memory stays bounded by the tensors being copied.
        workers = os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="xlm-weights")
        self._in_flight = threading.BoundedSemaphore(2 * workers)

    @property
    def placed(self) -> dict[str, jax.Array]:
        """Every parameter placed so far (waits for the copies in flight)."""
        for path, value in self._placed.items():
            if isinstance(value, Future):
                self._placed[path] = value.result()
        return self._placed  # type: ignore[return-value]

    def _copy_to_device(self, value: np.ndarray, dtype: np.dtype) -> jax.Array:
        try:
            # A fresh host array (the source may be a memory map that jax must not alias).
            if not value.flags.c_contiguous:  # a transposed view: device_put transposes
                return jax.device_put(np.array(value, dtype))  # faster than numpy does
            host = aligned_empty(value.shape, dtype)  # which a CPU device takes as it is
            np.copyto(host, value, casting="unsafe")
            return jax.device_put(host)
        finally:
            self._in_flight.release()

    def put_placed(self, path: str, value: np.ndarray) -> None:
        """A parameter already in its stored layout and dtype (the placed cache's)."""
        self._put_physical(path, value)

    def _put(self, path: str, value: np.ndarray) -> None:
        var = self.variables[path]
        metadata = var.get_metadata()
        value = to_physical(value, metadata)
        scheme = metadata.get("quantized")
        if scheme is not None and value.dtype != np.dtype(var.dtype):
            # A float kernel of a quantized projection: quantized here, with its scales
            # (per column, so after the physical layout, which only moves columns), in
            # the groups its scales have.
            scales = scale_path(path)
            groups = self.shapes[scales][0]
            kernel, scale, minimum = quantize(
                value, get_scheme(scheme), group_size=value.shape[0] // groups
            )
            self._put_physical(path, self._stored(path, kernel))
            self._put_physical(scales, self._stored(scales, scale))
            if min_path(path) in self.variables:  # symmetric: no minimum
                self._put_physical(
                    min_path(path), np.zeros_like(scale) if minimum is None else minimum
                )
            return
        self._put_physical(path, self._stored(path, value))

    def _stored(self, path: str, value: np.ndarray) -> np.ndarray:
        """A kernel or its scales in their stored layout: the q8 CPU kernel's strips
        (xlm.quantization.q8_kernel_strips) or a float kernel's [out, in] where the
        parameter is kept so."""
        var = self.variables[path]
        layout = stored_layout(var)
        if layout == "out_major":
            return np.ascontiguousarray(value.T)
        if layout == "q8_strips":
            return q8_scale_strips(value) if is_scale(var) else q8_kernel_strips(value)
        return value

    def _put_physical(self, path: str, value: np.ndarray) -> None:
        var = self.variables[path]
        dtype = stored_dtype(var, self.np_dtype)
        sharding = sharding_for(var, value.shape, self.mesh)
        if sharding is None:
            self._in_flight.acquire()
            self._placed[path] = self._pool.submit(self._copy_to_device, value, dtype)
            return
        # Each device receives only its own slice (also the only slices this process
        # addresses when the mesh spans hosts): never the whole tensor on one device.
        self._placed[path] = jax.make_array_from_callback(
            value.shape, sharding, lambda index: np.array(value[index], dtype)
        )

    def place_zeros(self, path: str) -> None:
        """A parameter the checkpoint does not have, as zeros."""
        self._put(path, np.zeros(self.shapes[path], self.np_dtype))

    def place(
        self, name: str, path: str, index: Any, value: np.ndarray, transposed: bool = False
    ) -> None:
        if path not in self.shapes:
            raise KeyError(f"checkpoint tensor {name!r} maps to unknown parameter {path!r}")
        shape = self.shapes[path]
        if index is None:
            if value.shape != shape:
                raise ValueError(
                    f"Shape mismatch for checkpoint tensor {name!r}: checkpoint shape "
                    f"{_source_shape(value, transposed)} vs model parameter {path!r} shape "
                    f"{shape}"
                    + (" ([in, out] kernel of an [out, in] weight)" if transposed else "")
                )
            self._put(path, value)
            return
        if path not in self._pending:  # float pieces, or a quantized checkpoint's own
            quantized = value.dtype == stored_dtype(self.variables[path], self.np_dtype)
            self._pending[path] = (np.zeros(shape, value.dtype if quantized else self.np_dtype), 0)
        buf, filled = self._pending[path]
        if buf[index].shape != value.shape:
            raise ValueError(
                f"Shape mismatch for checkpoint tensor {name!r}: checkpoint shape "
                f"{_source_shape(value, transposed)} vs its slot in model parameter {path!r} "
                f"{buf[index].shape} (parameter shape {shape})"
            )
        buf[index] = value
        filled += value.size
        if filled == buf.size:
            self._pending.pop(path, None)
            self._put(path, buf)
        else:
            self._pending[path] = (buf, filled)


def checkpoint_shape(var: nnx.Variable) -> tuple[int, ...]:
    """A parameter's shape in the checkpoint: its logical (unreplicated) shape, with a
    packed int4 kernel's [in / 2, out] bytes counted as the [in, out] weight they hold."""
    metadata = var.get_metadata()
    shape = logical_shape(tuple(var.shape), metadata)
    scheme = metadata.get("quantized")
    if scheme is not None and get_scheme(scheme).packed:
        return (shape[0] * 2, *shape[1:])
    return shape


def scale_path(kernel_path: str) -> str:
    """The WeightScale beside a quantized kernel (xlm.models.layers.Linear)."""
    return kernel_path.rpartition(".")[0] + ".weight_scale"


def min_path(kernel_path: str) -> str:
    """The per-group minimums beside a quantized kernel (GGUF types that have them)."""
    return kernel_path.rpartition(".")[0] + ".weight_min"


def is_scale(var: nnx.Variable) -> bool:
    from xlm.models.layers import WeightScale

    return isinstance(var, WeightScale)


def stored_layout(var: nnx.Variable) -> str:
    """How a parameter's stored layout departs from the checkpoint's ("" where it does
    not): a float kernel [out, in], a w8a8 kernel or its scales in strips."""
    metadata = var.get_metadata()
    return next((name for name in ("out_major", "q8_strips") if metadata.get(name)), "")


def stored_dtype(var: nnx.Variable, dtype: Any) -> np.dtype:
    """The element type a parameter is stored in: the model's dtype, except quantized
    kernels (their scheme's), their scales (float32) and the half kernels and tables of a
    float32 model (loader.resolve_weight_dtype)."""
    if "quantized" in var.get_metadata() or is_scale(var):
        return np.dtype(var.dtype)
    if np.dtype(dtype) == np.float32 and np.dtype(var.dtype) in HALF_DTYPES:
        return np.dtype(var.dtype)
    return np.dtype(dtype)


def _source_shape(value: np.ndarray, transposed: bool) -> tuple[int, ...]:
    shape = tuple(value.shape)
    return (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
