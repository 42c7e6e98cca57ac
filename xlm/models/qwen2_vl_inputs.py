"""Qwen2-VL / Qwen2.5-VL's host-side step inputs (numpy): the M-RoPE positions of a
request's tokens, and the packing of images into the encoder's patch-count buckets.

An image's features carry its patches and patch grid (t, h, w) from the processor
(xlm.multimodal.qwen2_vl); the encoder program (xlm.models.qwen2_vl) reads these arrays.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

# The smallest encoder patch bucket (a smaller image is padded up to it).
MIN_PATCH_BUCKET = 16


def llm_grid(feature: Any, merge_size: int) -> tuple[int, int, int]:
    """An image's token grid in the language model (t, h / merge, w / merge)."""
    t, h, w = feature.grid_thw
    return t, h // merge_size, w // merge_size


def mrope_positions(
    features: list[Any] | None, start: int, stop: int, merge_size: int
) -> np.ndarray:
    """M-RoPE positions [3, stop - start] of a request's prompt positions [start, stop)
    (decode tokens included), as transformers' get_rope_index: text advances all three
    streams by one; an image's tokens sit at (t, row, column) from where it starts, and the
    text after it resumes at that start plus the grid's longest side."""
    p = np.arange(start, stop, dtype=np.int64)
    out = np.broadcast_to(p, (3, p.size)).copy()
    shift = 0  # positions saved by the images before (image tokens - their extent)
    for f in sorted(features or (), key=lambda f: f.offset):
        t, gh, gw = llm_grid(f, merge_size)
        inside = (p >= f.offset) & (p < f.end)
        if inside.any():
            k = p[inside] - f.offset
            base = f.offset + shift
            out[0, inside] = base + k // (gh * gw)
            out[1, inside] = base + (k // gw) % gh
            out[2, inside] = base + k % gw
        delta = max(t, gh, gw) - f.length
        out[:, p >= f.end] += delta
        shift += delta
    return out


def step_mrope_positions(
    features: list[list[Any] | None],
    starts: np.ndarray,
    counts: np.ndarray,
    num_tokens_padded: int,
    merge_size: int,
) -> np.ndarray:
    """The step's M-RoPE positions [3, T] (request i's tokens at flat sum(counts[:i]);
    padding 0)."""
    out = np.zeros((3, num_tokens_padded), np.int32)
    flat = 0
    for feats, start, count in zip(features, starts, counts, strict=True):
        start, count = int(start), int(count)
        out[:, flat : flat + count] = mrope_positions(feats, start, start + count, merge_size)
        flat += count
    return out


def patch_buckets(min_patches: int, max_patches: int) -> tuple[int, ...]:
    """Encoder patch-count buckets: powers of two from the smallest image's patches up to
    the largest image's (which is the last bucket)."""
    out, b = [], max(MIN_PATCH_BUCKET, 1 << (max(min_patches, 1) - 1).bit_length())
    while b < max_patches:
        out.append(b)
        b *= 2
    return (*out, max_patches)


class PatchCountLayout:
    """How images go into the encoder program: packed by patch count into one of a few
    buckets, the rest padding (its own segment, writing the pool's scratch row 0)."""

    def __init__(self, vision_config: Any, min_pixels: int, max_tokens: int) -> None:
        self.merge_unit = vision_config.spatial_merge_size**2
        self.merge_size = vision_config.spatial_merge_size
        min_patches = max(min_pixels // vision_config.patch_size**2, self.merge_unit)
        self.buckets = patch_buckets(min_patches, max_tokens * self.merge_unit)
        self.patch_dim = (
            vision_config.in_channels
            * vision_config.temporal_patch_size
            * vision_config.patch_size**2
        )
        # Qwen2.5-VL: a window is this many merged tokens on a side.
        window = getattr(vision_config, "window_size", None)
        self.window = window // self.merge_size // vision_config.patch_size if window else None

    def take(self, pending: list[Any]) -> tuple[int, int]:
        """(bucket, images) for the next encoder call over `pending` features: as many as
        fit the largest bucket, in the smallest bucket that holds them."""
        total, n = 0, 0
        for f in pending:
            size = len(f.pixel_values)
            if n and total + size > self.buckets[-1]:
                break
            total, n = total + size, n + 1
        return next(b for b in self.buckets if b >= total), n

    def _windows(self, grid: tuple[int, int, int]) -> np.ndarray:
        """Each patch's window id within its image (0 without windows)."""
        t, h, w = grid
        m = self.merge_size
        if not self.window:
            return np.zeros(t * h * w, np.int32)
        hb, wb = np.meshgrid(np.arange(h // m), np.arange(w // m), indexing="ij")
        per_row = -(-(w // m) // self.window)
        unit = (hb // self.window) * per_row + (wb // self.window)
        return np.repeat(np.tile(unit.reshape(-1), t), self.merge_unit).astype(np.int32)

    def _positions(self, grid: tuple[int, int, int]) -> np.ndarray:
        """Each patch's (row, column) in the processor's merge-block order."""
        t, h, w = grid
        m = self.merge_size
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        return np.tile(np.stack([rows, cols], -1), (t, 1)).astype(np.int32)

    def arrays(self, bucket: int, batch: list[tuple[Any, int]]) -> tuple[dict, np.ndarray]:
        """The encoder's inputs for (feature, first pool row) pairs, and each merged
        token's pool row."""
        patches = np.zeros((bucket, self.patch_dim), np.float32)
        pos = np.zeros((bucket, 2), np.int32)
        seg = np.full(bucket, -1, np.int32)
        win = np.full(bucket, -1, np.int32)
        rows = np.zeros(bucket // self.merge_unit, np.int32)
        at, windows = 0, 0
        for j, (f, base_row) in enumerate(batch):
            n = len(f.pixel_values)
            patches[at : at + n] = f.pixel_values
            pos[at : at + n] = self._positions(f.grid_thw)
            seg[at : at + n] = j
            ids = self._windows(f.grid_thw)
            win[at : at + n] = windows + ids
            windows += int(ids.max()) + 1
            u = at // self.merge_unit
            rows[u : u + n // self.merge_unit] = base_row + np.arange(n // self.merge_unit)
            at += n
        return {"patches": patches, "pos": pos, "seg": seg, "win": win}, rows

    def spec(self, bucket: int, shape_of: Any) -> tuple[dict, Any]:
        """Example arguments (shapes) of the encoder program for `bucket` patches."""
        inputs = {
            "patches": shape_of((bucket, self.patch_dim), jnp.float32),
            "pos": shape_of((bucket, 2), jnp.int32),
            "seg": shape_of((bucket,), jnp.int32),
            "win": shape_of((bucket,), jnp.int32),
        }
        return inputs, shape_of((bucket // self.merge_unit,), jnp.int32)
