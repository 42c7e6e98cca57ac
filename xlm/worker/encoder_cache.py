"""The device encoder cache: image embeddings by content hash, and the encoder programs.

A device pool [1 + slots * tokens_per_image, hidden] holds encoder outputs; row 0 is a
scratch row (padding images write there, text tokens read it and ignore it). Each image
(keyed by its content hash, xlm.multimodal.processing.content_hash) takes one slot, so an
image shared by requests, or by the chunks of one prefill, is encoded once. Slots are
evicted least-recently-used, never one the current step reads (the scheduler caps a
step's images at the slot count; a slot holds the most tokens one image can become).

How images go into the encoder program is the model's layout: LLaVA's images have one
size, so its program is bucketed by image count (ImageCountLayout, powers of two);
Qwen2-VL's vary, so its program is bucketed by patch count
(xlm.multimodal.qwen2_vl.PatchCountLayout).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.distributed.mesh import put_replicated, replicated
from xlm.multimodal.inputs import features_in_range


def image_count_buckets(slots: int) -> tuple[int, ...]:
    """Powers of two up to the slots (and the slot count itself)."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return (*out, slots)


class ImageCountLayout:
    """Images of one shape, bucketed by how many go into one encoder call."""

    def __init__(self, slots: int, pixel_shape: tuple[int, ...], tokens_per_image: int) -> None:
        self.buckets = image_count_buckets(slots)
        self.pixel_shape = pixel_shape
        self.tokens_per_image = tokens_per_image

    def take(self, pending: list[Any]) -> tuple[int, int]:
        """(bucket, images) for the next encoder call over `pending` features."""
        n = len(pending)
        bucket = next((b for b in self.buckets if b >= n), self.buckets[-1])
        return bucket, min(n, bucket)

    def arrays(self, bucket: int, batch: list[tuple[Any, int]]) -> tuple[dict, np.ndarray]:
        """The encoder's inputs for (feature, first pool row) pairs and the pool rows of
        their tokens (padding images write row 0)."""
        pixels = np.zeros((bucket, *self.pixel_shape), np.float32)
        rows = np.zeros((bucket, self.tokens_per_image), np.int32)
        for j, (feature, base_row) in enumerate(batch):
            pixels[j] = feature.pixel_values
            rows[j, : feature.length] = base_row + np.arange(feature.length)
        return {"pixel_values": pixels}, rows

    def spec(self, bucket: int, shape_of: Any) -> tuple[dict, Any]:
        """Example arguments (shapes) of the encoder program for `bucket` images."""
        return (
            {"pixel_values": shape_of((bucket, *self.pixel_shape), jnp.float32)},
            shape_of((bucket, self.tokens_per_image), jnp.int32),
        )


class EncoderCache:
    """Host bookkeeping of the device pool: hash -> slot, LRU order, hit counters."""

    def __init__(self, slots: int, tokens_per_image: int) -> None:
        self.slots = slots
        self.tokens_per_image = tokens_per_image
        self.num_rows = 1 + slots * tokens_per_image
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self.free = list(range(slots - 1, -1, -1))
        self.hits = 0  # images found encoded
        self.misses = 0  # images encoded

    def base_row(self, slot: int) -> int:
        return 1 + slot * self.tokens_per_image

    def lookup(self, identifier: str) -> int | None:
        """The slot holding this image (marked recently used), or None."""
        slot = self.slot_of.get(identifier)
        if slot is not None:
            self.slot_of.move_to_end(identifier)
        return slot

    def assign(self, identifier: str, pinned: set[str]) -> int:
        """A slot for a new image: a free one, else the least recently used not pinned."""
        if not self.free:
            victim = next((k for k in self.slot_of if k not in pinned), None)
            if victim is None:
                raise RuntimeError(
                    f"the encoder cache's {self.slots} slots are all read by this step"
                )
            self.free.append(self.slot_of.pop(victim))
        slot = self.free.pop()
        self.slot_of[identifier] = slot
        return slot


class EncoderRunner:
    """Encodes a step's images into the pool and maps its tokens to pool rows."""

    def __init__(
        self,
        graphdef: Any,
        state: Any,
        slots: int,
        tokens_per_image: int,
        hidden: int,
        mesh: jax.sharding.Mesh | None,
        layout: Any,
    ) -> None:
        self.cache = EncoderCache(slots, tokens_per_image)
        self.graphdef = graphdef
        self.layout = layout
        self.buckets = layout.buckets
        self.hidden = hidden
        # Under a mesh the pool and the images are replicated: every device runs the
        # whole encoder (docs/multimodal.md).
        self.mesh = mesh
        self.dtype = jax.tree_util.tree_leaves(state)[0].dtype
        self.encode_fn = jax.jit(self._encode_step, donate_argnums=(1,))

    def _encode_step(
        self, state: nnx.State, pool: jax.Array, inputs: dict, rows: jax.Array
    ) -> jax.Array:
        """Encode a bucket of images (the layout's inputs) and write their embeddings at
        `rows` (one per embedding, in order)."""
        model = nnx.merge(self.graphdef, state)
        embeds = model.encode_images(**inputs)  # [..., hidden]
        flat = embeds.reshape(-1, embeds.shape[-1]).astype(pool.dtype)
        pool = pool.at[rows.reshape(-1)].set(flat)
        if self.mesh is None:
            return pool
        # The pool stays whole on every device, the layout the step programs read.
        return jax.lax.with_sharding_constraint(pool, replicated(self.mesh))

    def pool_shape(self) -> tuple[int, int]:
        return (self.cache.num_rows, self.hidden)

    def step_rows(
        self,
        features: list[list[Any] | None],
        starts: np.ndarray,
        counts: np.ndarray,
        num_tokens_padded: int,
    ) -> tuple[np.ndarray, list[Any]]:
        """Per token of the step its pool row (0: its own embedding), and the images to
        encode first (feature, slot). Request i computes positions [starts[i],
        starts[i] + counts[i]) at flat tokens from sum(counts[:i])."""
        mm_rows = np.zeros(num_tokens_padded, np.int32)
        needed = []
        flat = 0
        for feats, start, count in zip(features, starts, counts, strict=True):
            stop = int(start + count)
            for f in features_in_range(feats, int(start), stop):
                needed.append((f, flat, int(start), stop))
            flat += int(count)
        pinned = {f.identifier for f, *_ in needed}
        to_encode = []
        for f, flat0, start, stop in needed:
            # A miss encodes the image; every other read of it (another request, a later
            # chunk of the same prompt) is a hit.
            slot = self.cache.lookup(f.identifier)
            if slot is None:
                slot = self.cache.assign(f.identifier, pinned)
                self.cache.misses += 1
                to_encode.append((f, slot))
            else:
                self.cache.hits += 1
            lo, hi = max(start, f.offset), min(stop, f.end)
            tokens = flat0 + np.arange(lo - start, hi - start)
            mm_rows[tokens] = self.cache.base_row(slot) + np.arange(lo - f.offset, hi - f.offset)
        return mm_rows, to_encode

    def encode(self, program_for: Any, state: Any, pool: Any, to_encode: list[Any]) -> Any:
        """Run the encoder program over the images to encode (in batches the layout
        buckets); returns the updated pool."""
        pending = list(to_encode)
        while pending:
            bucket, n = self.layout.take([f for f, _ in pending])
            batch = [(f, self.cache.base_row(slot)) for f, slot in pending[:n]]
            pending = pending[n:]
            inputs, rows = self.layout.arrays(bucket, batch)
            pool = program_for(bucket)(
                state,
                pool,
                {k: put_replicated(v, self.mesh) for k, v in inputs.items()},
                put_replicated(rows, self.mesh),
            )
        return pool

    def spec_args(self, bucket: int, shape_of: Any) -> tuple:
        """Example arguments of the encoder program for one bucket (for lowering)."""
        return self.layout.spec(bucket, shape_of)
