"""One host-to-device transfer per step: pack a pytree of numpy arrays into one buffer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# (dtype name, shape, offset) per leaf, plus the pytree structure: static under jit.
Layout = tuple[Any, tuple[tuple[str, tuple[int, ...], int], ...]]


def pack(tree: Any) -> tuple[np.ndarray, Layout]:
    """Flatten a pytree of numpy arrays into one int32 buffer and its static layout."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs, parts, offset = [], [], 0
    for leaf in leaves:
        arr = np.asarray(leaf)
        if arr.dtype in (np.float32, np.uint32):
            kind, flat = arr.dtype.name, arr.reshape(-1).view(np.int32)
        elif arr.dtype == np.uint8:  # four bytes to a word
            raw = arr.reshape(-1)
            raw = np.concatenate([raw, np.zeros(-raw.size % 4, np.uint8)])
            kind, flat = "uint8", raw.view(np.int32)
        elif arr.dtype == np.bool_:
            kind, flat = "bool", arr.reshape(-1).astype(np.int32)
        else:
            kind, flat = "int32", arr.reshape(-1).astype(np.int32, copy=False)
        specs.append((kind, arr.shape, offset))
        parts.append(flat)
        offset += flat.size
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buffer, (treedef, tuple(specs))


def unpack(buffer: jax.Array, layout: Layout) -> Any:
    """Inverse of pack, traced inside the jitted step (static slices and bitcasts)."""
    treedef, specs = layout
    leaves = []
    for kind, shape, offset in specs:
        size = int(np.prod(shape, dtype=np.int64))
        words = -(-size // 4) if kind == "uint8" else size
        flat = jax.lax.slice_in_dim(buffer, offset, offset + words)
        if kind in ("float32", "uint32"):
            flat = jax.lax.bitcast_convert_type(flat, jnp.dtype(kind))
        elif kind == "uint8":
            flat = jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)[:size]
        elif kind == "bool":
            flat = flat != 0
        leaves.append(flat.reshape(shape))
    return jax.tree_util.tree_unflatten(treedef, leaves)
