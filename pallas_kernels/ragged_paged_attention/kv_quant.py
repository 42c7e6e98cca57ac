"""KV cache element types, in one place for the reference, the native op and both kernels.

A float cache (float32, bfloat16, float16, fp8) stores K and V as they are (fp8 saturating)
and is widened to the queries' dtype when read. An int8 cache stores each (token, kv head)
row of K or V like one llama.cpp q8_0 block: `head_dim` symmetric int8 codes followed by the
row's float32 scale (max|row| / 127) as 4 bytes, so a cache row is `head_dim + 4` wide and a
layer's cache stays one array (allocation, donation, head sharding and sizing unchanged).
Reads split each row into codes and scale and widen to codes * scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

SCALE_BYTES = 4  # one float32 scale per cached row of an int8 cache


def is_int8(dtype) -> bool:
    """Whether `dtype` is the int8-with-scales cache type."""
    return jnp.dtype(dtype) == jnp.int8


def cache_row_width(head_dim: int, dtype) -> int:
    """Elements (= bytes for 1-byte types) of one cached (token, kv head) row."""
    return head_dim + SCALE_BYTES if is_int8(dtype) else head_dim


def row_head_dim(row_width: int, dtype) -> int:
    """head_dim of a cache whose rows are `row_width` wide."""
    return row_width - SCALE_BYTES if is_int8(dtype) else row_width


def quantize(kv: jax.Array, dtype) -> jax.Array:
    """Rows [..., head_dim] as stored in a `dtype` cache ([..., cache_row_width]).

    fp8 saturates at its largest finite value (an out-of-range float would become NaN:
    e4m3fn has no infinity); int8 rounds kv / scale to the nearest code (half to even)."""
    dtype = jnp.dtype(dtype)
    if is_int8(dtype):
        x = kv.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
        codes = jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0)
        codes = jnp.clip(jnp.round(codes), -127, 127).astype(jnp.int8)
        return jnp.concatenate([codes, lax.bitcast_convert_type(scale, jnp.int8)[..., 0, :]], -1)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        kv = jnp.clip(kv, -limit, limit)
    return kv.astype(dtype)


def scale_of(scale_bytes: jax.Array) -> jax.Array:
    """[..., 4] int8 bytes of little-endian float32s -> [...] float32, in arithmetic that
    Triton and Mosaic lower (float sums of whole bytes are exact; no narrowing bitcast)."""
    b = jnp.bitwise_and(scale_bytes.astype(jnp.int32), 0xFF).astype(jnp.float32)
    lane = lax.broadcasted_iota(jnp.int32, b.shape, b.ndim - 1)
    lo = jnp.sum(jnp.where(lane == 0, b, 0.0) + jnp.where(lane == 1, b * 256.0, 0.0), axis=-1)
    hi = jnp.sum(jnp.where(lane == 2, b, 0.0) + jnp.where(lane == 3, b * 256.0, 0.0), axis=-1)
    word = jnp.left_shift(hi.astype(jnp.int32), 16) | lo.astype(jnp.int32)
    return lax.bitcast_convert_type(word, jnp.float32)


def dequantize(
    rows: jax.Array, dtype, *, in_kernel: bool = False, head_dim: int | None = None
) -> jax.Array:
    """Cached rows [..., cache_row_width] -> [..., head_dim] values in `dtype`.

    `in_kernel`: decode the scale with `scale_of` (Pallas) instead of a narrowing bitcast.
    `head_dim`: rows wider than `cache_row_width(head_dim)` (the TPU layout pads rows to
    the 128 lanes) keep their width, with the scale and padding lanes read as zeros."""
    if not is_int8(rows.dtype):
        return rows.astype(dtype)
    width = rows.shape[-1]
    head_dim = width - SCALE_BYTES if head_dim is None else head_dim
    scale_bytes = rows[..., head_dim : head_dim + SCALE_BYTES]
    if in_kernel:
        scale = scale_of(scale_bytes)
    else:
        scale = lax.bitcast_convert_type(scale_bytes, jnp.float32)
    if head_dim + SCALE_BYTES == width:
        return (rows[..., :head_dim].astype(jnp.float32) * scale[..., None]).astype(dtype)
    lane = lax.broadcasted_iota(jnp.int32, rows.shape, rows.ndim - 1)
    values = rows.astype(jnp.float32) * scale[..., None]
    return jnp.where(lane < head_dim, values, 0.0).astype(dtype)
