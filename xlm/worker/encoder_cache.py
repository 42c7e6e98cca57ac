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

from xlm.config import XlmConfig
from xlm.distributed.mesh import put_replicated, replicated, replicated_shape
from xlm.models.loader import resolve_dtype
from xlm.multimodal.budget import bidirectional_images, encoder_cache_slots, tokens_per_image
from xlm.multimodal.inputs import features_in_range
from xlm.multimodal.processor_config import resolve_processor_config
from xlm.worker.compilation import ProgramKey, ProgramKind, ProgramSpec, ProgramStore
from xlm.worker.programs import Weights


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
    """Encodes a step's images into the pool and maps its tokens to pool rows.

    The runner's model program reads `pool`; `plan_step` maps a step's tokens to pool rows
    and notes its images not yet encoded, which `encode_pending` encodes before the step.
    """

    @classmethod
    def of(
        cls,
        config: XlmConfig,
        model: Any,
        graphdef: Any,
        weights: Weights,
        mesh: Any,
        abstract: bool,
    ) -> EncoderRunner | None:
        """A multimodal model's encoder runner with its pool placed (its shape only on a
        compile target's runner), or None for a text model."""
        hf_config = config.model_config.hf_config
        processor_config = resolve_processor_config(config)
        max_tokens = config.scheduler_config.max_num_batched_tokens
        slots = encoder_cache_slots(hf_config, max_tokens, processor_config)
        if not slots:
            return None
        per_image = tokens_per_image(hf_config, processor_config)
        if hasattr(model, "encoder_layout"):  # images of varying size (Qwen2-VL)
            layout = model.encoder_layout(hf_config, processor_config)
        else:  # images of one size (LLaVA)
            vision = hf_config.vision_config
            shape = (vision.num_channels, vision.image_size, vision.image_size)
            layout = ImageCountLayout(slots, shape, per_image)
        # The pool holds embeddings in the model's compute dtype (the first state leaf can
        # be an 8-bit kernel under quantization).
        dtype = jnp.dtype(resolve_dtype(config.model_config.dtype, hf_config))
        encoder = cls(
            graphdef, weights, slots, per_image, hf_config.hidden_size, mesh, layout, dtype
        )
        encoder.mrope = getattr(model, "mrope_positions", None)
        encoder.bidirectional = bidirectional_images(hf_config)
        pool = replicated_shape(encoder.pool_shape(), encoder.dtype, mesh)
        encoder.pool = pool if abstract else put_replicated(np.zeros(pool.shape, pool.dtype), mesh)
        return encoder

    def __init__(
        self,
        graphdef: Any,
        weights: Weights,
        slots: int,
        tokens_per_image: int,
        hidden: int,
        mesh: jax.sharding.Mesh | None,
        layout: Any,
        dtype: Any,
    ) -> None:
        self.cache = EncoderCache(slots, tokens_per_image)
        self.graphdef = graphdef
        # The runner's programs.Weights: the program takes the flat list of arrays, as the
        # step programs do (no Python flatten of the nnx.State per call).
        self.weights = weights
        self.layout = layout
        self.buckets = layout.buckets
        self.hidden = hidden
        # Under a mesh the pool and the images are replicated: every device runs the
        # whole encoder (docs/multimodal.md).
        self.mesh = mesh
        self.dtype = dtype
        self.encode_fn = jax.jit(self._encode_step, donate_argnums=(1,))
        # An M-RoPE model's step positions from its features (the model's mrope_positions).
        self.mrope: Any = None
        # Images whose tokens attend to each other both ways (Gemma 3): attend_until.
        self.bidirectional = False
        self.pool: Any = None
        self.to_encode: list[Any] = []  # the planned step's images not in the cache

    def _encode_step(
        self, weights: list[jax.Array], pool: jax.Array, inputs: dict, rows: jax.Array
    ) -> jax.Array:
        """Encode a bucket of images (the layout's inputs) and write their embeddings at
        `rows` (one per embedding, in order)."""
        model = nnx.merge(self.graphdef, self.weights.state(weights))
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

    @staticmethod
    def attend_until(
        features: list[list[Any] | None], positions: np.ndarray, starts: Any, counts: Any
    ) -> np.ndarray:
        """Per token the last context position it attends to (AttentionMetadata's
        attend_until): its own, or its image's last for an image token (images attended
        both ways, whose tokens the scheduler keeps in one step)."""
        limit = positions.copy()
        flat = 0
        for feats, start, count in zip(features, starts, counts, strict=True):
            start, stop = int(start), int(start + count)
            for f in features_in_range(feats, start, stop):
                lo, hi = max(start, f.offset), min(stop, f.end)
                limit[flat + lo - start : flat + hi - start] = f.end - 1
            flat += int(count)
        return limit

    def encode(self, program_for: Any, pool: Any, to_encode: list[Any]) -> Any:
        """Run the encoder program over the images to encode (in batches the layout
        buckets); returns the updated pool."""
        pending = list(to_encode)
        weights = self.weights.arrays()
        while pending:
            bucket, n = self.layout.take([f for f, _ in pending])
            batch = [(f, self.cache.base_row(slot)) for f, slot in pending[:n]]
            pending = pending[n:]
            inputs, rows = self.layout.arrays(bucket, batch)
            pool = program_for(bucket)(
                weights,
                pool,
                {k: put_replicated(v, self.mesh) for k, v in inputs.items()},
                put_replicated(rows, self.mesh),
            )
        return pool

    def stats(self) -> dict[str, int]:
        """Images found in the encoder cache (hits) and encoded (misses) so far."""
        return {"hits": self.cache.hits, "misses": self.cache.misses}

    def plan_step(
        self,
        batch: Any,
        req_ids: list[str],
        num_scheduled: list[int],
        num_tokens_padded: int,
        positions: np.ndarray,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The step's `mm_rows` (step_rows over the InputBatch's requests) and what its
        images change in the step's attention metadata: an M-RoPE model's [3, T]
        positions (Qwen2-VL), each token's attend_until for images attended both ways
        (Gemma 3). Its images not yet encoded wait for encode_pending."""
        features = [batch.requests[r].mm_features for r in req_ids]
        starts = batch.num_computed_tokens[batch.slots(req_ids)] if req_ids else []
        starts, counts = np.asarray(starts), np.asarray(num_scheduled)
        mm_rows, self.to_encode = self.step_rows(features, starts, counts, num_tokens_padded)
        changes = {}
        if self.mrope is not None:
            changes["positions"] = self.mrope(features, starts, counts, num_tokens_padded)
        if self.bidirectional:
            changes["attend_until"] = self.attend_until(features, positions, starts, counts)
        return mm_rows, changes

    def encode_pending(self, store: ProgramStore, mesh_spec: Any) -> Any:
        """Encode the planned step's images not in the cache (first, before the step's
        model program reads the pool); the pool."""
        if self.to_encode:

            def program_for(bucket: int) -> Any:
                key = ProgramKey(ProgramKind.ENCODER, bucket, mesh_spec)
                return store.get(key, lambda: self.spec(bucket))

            self.pool = self.encode(program_for, self.pool, self.to_encode)
            self.to_encode = []
        return self.pool

    def spec(self, bucket: int) -> ProgramSpec:
        """The encoder program for `bucket` images (example arguments to lower with)."""
        pool = replicated_shape(self.pool_shape(), self.dtype, self.mesh)
        inputs, rows = self.layout.spec(
            bucket, lambda shape, dtype: replicated_shape(shape, dtype, self.mesh)
        )
        out_tree = jax.tree_util.tree_structure(0)
        args = (self.weights.arrays(), pool, inputs, rows)
        return ProgramSpec(self.encode_fn, args, None, out_tree, self.mesh)

    def specs(self, mesh_spec: Any) -> dict[ProgramKey, ProgramSpec]:
        """The encoder programs, one per bucket of the layout (image or patch count)."""
        return {ProgramKey(ProgramKind.ENCODER, b, mesh_spec): self.spec(b) for b in self.buckets}
