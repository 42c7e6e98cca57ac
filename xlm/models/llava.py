"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer GELU
projector and a Llama language model.

The language model is LlamaForCausalLM's (same parameter paths, so the runner treats it as
any decoder); `encode_images` is the vision encoder program's body: pixels -> one
embedding per image placeholder token. The step program puts those embeddings in place of
the placeholder tokens' (xlm.worker.programs), as transformers' forward does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.clip import CLIPVisionTransformer, _linear
from xlm.models.llama import LlamaForCausalLM
from xlm.models.weights import WeightTarget, default_weight_targets

# Checkpoint name prefixes of a vision-language model (transformers 4's layout, as
# llava-hf's, and 5's) -> xlm's.
_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def tower_name(name: str) -> tuple[str, str | None]:
    """A vision-language checkpoint's tensor name in xlm's layout, and its name inside
    the vision tower (None: not a tower tensor)."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
    if name.startswith("vision_tower."):
        return name, name[len("vision_tower.") :]
    return name, None


def vision_layers_run(vision_config: Any, feature_layer: Any) -> int:
    """How many encoder layers run to reach `vision_feature_layer` (an index into
    transformers' hidden_states, whose entry 0 is the embeddings)."""
    if not isinstance(feature_layer, int):
        raise ValueError(
            f"vision_feature_layer={feature_layer!r} is not supported: allowed one integer"
        )
    total = vision_config.num_hidden_layers
    index = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
    if not 0 <= index <= total:
        raise ValueError(
            f"vision_feature_layer={feature_layer} is out of range for {total} vision layers"
        )
    return index


class LlavaMultiModalProjector(nnx.Module):
    """linear_1 -> GELU -> linear_2: vision features into the language model's space."""

    def __init__(self, config: Any, *, dtype: Any, rngs: nnx.Rngs) -> None:
        vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = _linear(vision, text, dtype, rngs, bias)
        self.linear_2 = _linear(text, text, dtype, rngs, bias)
        act = getattr(config, "projector_hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"projector_hidden_act={act!r} is not supported: allowed 'gelu'")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(jax.nn.gelu(self.linear_1(x), approximate=False))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA-1.5: the Llama decoder plus the vision tower and projector."""

    # The submodules the encoder programs run (xlm plan counts their weights apart).
    encoder_modules = ("vision_tower", "multi_modal_projector")

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(hf_config.text_config, dtype=dtype, rngs=rngs)
        vision = hf_config.vision_config
        self.num_vision_layers = vision_layers_run(vision, hf_config.vision_feature_layer)
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy={strategy!r} is invalid: allowed 'default', 'full'"
            )
        self.drop_cls = strategy == "default"
        self.vision_tower = CLIPVisionTransformer(
            vision, self.num_vision_layers, dtype=dtype, rngs=rngs
        )
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config, dtype=dtype, rngs=rngs)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, C, H, W] -> embeddings [B, tokens per image, hidden]."""
        features = self.vision_tower(pixel_values.astype(self.embed_dtype()))
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_input_ids(self, input_ids: jax.Array) -> jax.Array:
        """The language model's token embeddings [T, H] (placeholders then replaced)."""
        return self.model.embed_tokens(input_ids)

    def embed_dtype(self) -> Any:
        return self.model.embed_tokens.dtype  # the activations' (a half table on CPU: float32)

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        """LLaVA's checkpoint names onto the decoder's and the tower's parameters; vision
        layers past the one read (and the unused post-LayerNorm) are skipped."""
        name, rest = tower_name(name)
        if rest is not None:
            if rest.startswith("post_layernorm."):
                return [WeightTarget.skip()]
            if rest.startswith("encoder.layers."):
                index = int(rest.split(".")[2])
                if index >= self.num_vision_layers:
                    return [WeightTarget.skip()]
                name = "vision_tower." + rest[len("encoder.") :]
        return super().hf_weight_targets(name, param_shapes) or default_weight_targets(
            name, param_shapes
        )
