"""The device encoder cache: image embeddings by content hash, and the encoder programs.

A device pool [1 + slots * tokens_per_image, hidden] holds encoder outputs; row 0 is a
scratch row (padding images write there, text tokens read it and ignore it). Each image
(keyed by its content hash, xlm.multimodal.processing.content_hash) takes one slot, so an
image shared by requests, or by the chunks of one prefill, is encoded once. Slots are
evicted least-recently-used, never one the current step reads (the scheduler caps a
step's images at the slot count). The encoder program is bucketed by image count (powers
of two): images of one family have one size, so that is its only shape.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlm.config import XlmConfig
from xlm.distributed.mesh import put_replicated, replicated, replicated_shape
from xlm.multimodal.budget import encoder_cache_slots, tokens_per_image
from xlm.multimodal.inputs import features_in_range
from xlm.worker.compilation import ProgramKey, ProgramKind, ProgramSpec, ProgramStore


def image_count_buckets(slots: int) -> tuple[int, ...]:
    """Powers of two up to the slots (and the slot count itself)."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return (*out, slots)


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
    """Encodes a step's images into the pool and maps its tokens to pool rows.

    The runner's model program reads `pool`; `plan_step` maps a step's tokens to pool rows
    and notes its images not yet encoded, which `encode_pending` encodes before the step.
    """

    @classmethod
    def of(
        cls, config: XlmConfig, graphdef: Any, state: Any, mesh: Any, abstract: bool
    ) -> EncoderRunner | None:
        """A multimodal model's encoder runner with its pool placed (its shape only on a
        compile target's runner), or None for a text model."""
        hf_config = config.model_config.hf_config
        slots = encoder_cache_slots(hf_config, config.scheduler_config.max_num_batched_tokens)
        if not slots:
            return None
        hidden = hf_config.hidden_size
        encoder = cls(graphdef, state, slots, tokens_per_image(hf_config), hidden, mesh)
        vision = hf_config.vision_config
        encoder.pixel_shape = (vision.num_channels, vision.image_size, vision.image_size)
        pool = replicated_shape(encoder.pool_shape(), encoder.dtype, mesh)
        encoder.pool = pool if abstract else put_replicated(np.zeros(pool.shape, pool.dtype), mesh)
        return encoder

    def __init__(
        self,
        graphdef: Any,
        state: Any,
        slots: int,
        tokens_per_image: int,
        hidden: int,
        mesh: jax.sharding.Mesh | None,
    ) -> None:
        self.cache = EncoderCache(slots, tokens_per_image)
        self.graphdef = graphdef
        self.buckets = image_count_buckets(slots)
        self.hidden = hidden
        # Under a mesh the pool and the images are replicated: every device runs the
        # whole encoder (docs/multimodal.md).
        self.mesh = mesh
        self.dtype = jax.tree_util.tree_leaves(state)[0].dtype
        self.encode_fn = jax.jit(self._encode_step, donate_argnums=(1,))
        self.pixel_shape: tuple[int, ...] = ()
        self.pool: Any = None
        self.to_encode: list[Any] = []  # the planned step's images not in the cache

    def _encode_step(
        self, state: nnx.State, pool: jax.Array, pixels: jax.Array, rows: jax.Array
    ) -> jax.Array:
        """Encode images [B, C, H, W] and write their embeddings at rows [B, tokens]."""
        model = nnx.merge(self.graphdef, state)
        embeds = model.encode_images(pixels)  # [B, tokens, hidden]
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
        """Run the encoder program over the images to encode (in bucket-sized batches);
        returns the updated pool."""
        n_tok = self.cache.tokens_per_image
        i = 0
        while i < len(to_encode):
            bucket = next((b for b in self.buckets if b >= len(to_encode) - i), self.buckets[-1])
            batch = to_encode[i : i + bucket]
            shape = batch[0][0].pixel_values.shape
            pixels = np.zeros((bucket, *shape), np.float32)
            rows = np.zeros((bucket, n_tok), np.int32)  # padding images write row 0
            for j, (feature, slot) in enumerate(batch):
                pixels[j] = feature.pixel_values
                rows[j, : feature.length] = self.cache.base_row(slot) + np.arange(feature.length)
            program = program_for(bucket)
            pool = program(
                state, pool, put_replicated(pixels, self.mesh), put_replicated(rows, self.mesh)
            )
            i += bucket
        return pool

    def stats(self) -> dict[str, int]:
        """Images found in the encoder cache (hits) and encoded (misses) so far."""
        return {"hits": self.cache.hits, "misses": self.cache.misses}

    def plan_step(
        self, batch: Any, req_ids: list[str], num_scheduled: list[int], num_tokens_padded: int
    ) -> np.ndarray:
        """The step's `mm_rows` (step_rows over the InputBatch's requests); its images
        not yet encoded wait for encode_pending."""
        features = [batch.requests[r].mm_features for r in req_ids]
        starts = batch.num_computed_tokens[batch.slots(req_ids)] if req_ids else []
        mm_rows, self.to_encode = self.step_rows(
            features, np.asarray(starts), np.asarray(num_scheduled), num_tokens_padded
        )
        return mm_rows

    def encode_pending(self, store: ProgramStore, state: Any, mesh_spec: Any) -> Any:
        """Encode the planned step's images not in the cache (first, before the step's
        model program reads the pool); the pool."""
        if self.to_encode:

            def program_for(bucket: int) -> Any:
                key = ProgramKey(ProgramKind.ENCODER, bucket, mesh_spec)
                return store.get(key, lambda: self.spec(state, bucket))

            self.pool = self.encode(program_for, state, self.pool, self.to_encode)
            self.to_encode = []
        return self.pool

    def spec(self, state: Any, bucket: int) -> ProgramSpec:
        """The encoder program for `bucket` images (example arguments to lower with)."""
        pool = replicated_shape(self.pool_shape(), self.dtype, self.mesh)
        pixels = replicated_shape((bucket, *self.pixel_shape), jnp.float32, self.mesh)
        rows = replicated_shape((bucket, self.cache.tokens_per_image), jnp.int32, self.mesh)
        out_tree = jax.tree_util.tree_structure(0)
        return ProgramSpec(self.encode_fn, (state, pool, pixels, rows), None, out_tree, self.mesh)

    def specs(self, state: Any, mesh_spec: Any) -> dict[ProgramKey, ProgramSpec]:
        """The encoder programs, one per image-count bucket."""
        return {
            ProgramKey(ProgramKind.ENCODER, b, mesh_spec): self.spec(state, b) for b in self.buckets
        }
