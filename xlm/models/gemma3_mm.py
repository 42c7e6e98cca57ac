"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, Gemma
3's projector (average pooling to `mm_tokens_per_image`, a (1 + w) RMSNorm, a
projection) and the Gemma 3 text decoder of xlm.models.gemma2.

`encode_images` is the vision encoder program's body (pixels -> one embedding per image
soft token); the step program puts those embeddings in place of the image tokens'
(xlm.worker.programs). Gemma 3's image tokens attend to each other both ways in prefill,
as transformers' token_type_ids mask does: the runner passes each token's attention
limit (AttentionMetadata.attend_until, docs/multimodal.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.clip import SiglipVisionTransformer
from xlm.models.gemma2 import NORM_OFFSET, Gemma3ForCausalLM
from xlm.models.layers import param, unloaded
from xlm.models.llava import tower_name
from xlm.models.weights import WeightTarget, default_weight_targets
from xlm.ops import RMSNorm


def pooling_kernel(config: Any) -> int:
    """Side of the average-pooling window from the patch grid to mm_tokens_per_image."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    tokens_side = int(round(config.mm_tokens_per_image**0.5))
    if tokens_side * tokens_side != config.mm_tokens_per_image or side % tokens_side:
        raise ValueError(
            f"mm_tokens_per_image={config.mm_tokens_per_image} is not supported: allowed a "
            f"square whose side divides the {side}x{side} patch grid"
        )
    return side // tokens_side


class Gemma3MultiModalProjector(nnx.Module):
    """Average-pool the patch grid, (1 + w) RMSNorm, project to the text hidden size."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
        self.side = config.vision_config.image_size // config.vision_config.patch_size
        self.kernel = pooling_kernel(config)
        # Stored [vision, text] (x @ W), replicated like the tower.
        self.mm_input_projection_weight = param(unloaded((vision, text), dtype), (None, None))
        self.mm_soft_emb_norm = RMSNorm(
            vision, config.vision_config.layer_norm_eps, dtype=dtype, weight_offset=NORM_OFFSET
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Patches [B, side * side, D] -> [B, mm_tokens_per_image, text hidden]."""
        b, _, d = x.shape
        s, k = self.side, self.kernel
        grid = x.reshape(b, s // k, k, s // k, k, d)
        pooled = grid.astype(jnp.float32).mean(axis=(2, 4)).astype(x.dtype)
        pooled = pooled.reshape(b, (s // k) ** 2, d)
        normed = self.mm_soft_emb_norm(pooled)
        return normed @ self.mm_input_projection_weight[...].astype(normed.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 (4B and larger): the text decoder plus the vision tower and projector."""

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(hf_config.text_config, dtype=dtype, rngs=rngs)
        self.vision_tower = SiglipVisionTransformer(hf_config.vision_config, dtype=dtype, rngs=rngs)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config, dtype=dtype, rngs=rngs)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, H, W] -> embeddings [B, mm_tokens_per_image, hidden]."""
        features = self.vision_tower(pixel_values.astype(self.embed_dtype()))
        return self.multi_modal_projector(features)

    def embed_input_ids(self, input_ids: jax.Array) -> jax.Array:
        """The text model's scaled token embeddings [T, H] (image tokens then replaced)."""
        return self.model.embed(input_ids)

    def embed_dtype(self) -> Any:
        return self.model.embed_tokens.weight.dtype

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        """Gemma 3's checkpoint names onto the decoder's, the tower's and the projector's
        parameters (the SigLIP pooling head, absent in Gemma 3, is skipped)."""
        name, rest = tower_name(name)
        if rest is not None:
            if rest.startswith("head."):
                return [WeightTarget.skip()]
            name = "vision_tower." + rest.replace("encoder.layers.", "layers.", 1)
        return super().hf_weight_targets(name, param_shapes) or default_weight_targets(
            name, param_shapes
        )
