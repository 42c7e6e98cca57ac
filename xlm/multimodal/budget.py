"""How much encoder output the engine holds: the device encoder cache's image slots.

The runner keeps encoder embeddings in a device pool of fixed slots (each holds one
image's tokens); the scheduler lets a step cover the placeholders of at most that many
distinct images, so the images a step reads always fit the pool at once.
"""

from __future__ import annotations

from typing import Any

from xlm.multimodal.processor_config import QWEN2_VL_TYPES, qwen2_vl_factor, qwen2_vl_pixel_limits

# The least slots, so a few images are reused across requests even with a small budget.
MIN_ENCODER_SLOTS = 4


def qwen2_vl_max_tokens(processor_config: dict[str, Any] | None) -> tuple[int, int]:
    """(min_pixels, the most tokens one image becomes) from a Qwen2-VL preprocessor config
    (the engine's: xlm.multimodal.processor_config)."""
    config = processor_config or {}
    low, high = qwen2_vl_pixel_limits(config)
    return low, max(high // qwen2_vl_factor(config) ** 2, 1)


def _llava_tokens(hf_config: Any, processor_config: dict | None) -> int:
    vision = hf_config.vision_config
    full = getattr(hf_config, "vision_feature_select_strategy", "default") == "full"
    return (vision.image_size // vision.patch_size) ** 2 + int(full)


# model_type -> the most tokens one image becomes (its encoder's embeddings).
_TOKENS_PER_IMAGE = {
    "llava": _llava_tokens,
    "gemma3": lambda hf_config, processor_config: int(hf_config.mm_tokens_per_image),
    **{t: lambda hf_config, pc: qwen2_vl_max_tokens(pc)[1] for t in QWEN2_VL_TYPES},
}
# Families whose image tokens attend to each other both ways (Gemma 3): an image's tokens
# are prefilled in one step, so the scheduler never cuts a chunk inside one.
_BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})


def tokens_per_image(hf_config: Any, processor_config: dict | None = None) -> int | None:
    """The most placeholder tokens one image becomes for this model (None: no images),
    under the engine's preprocessor config (None: the family's defaults)."""
    count = _TOKENS_PER_IMAGE.get(getattr(hf_config, "model_type", None))
    if count is None or getattr(hf_config, "vision_config", None) is None:
        return None
    return count(hf_config, processor_config)


def bidirectional_images(hf_config: Any) -> bool:
    """Whether an image's tokens attend to each other both ways (one prefill chunk each)."""
    return (
        getattr(hf_config, "vision_config", None) is not None
        and getattr(hf_config, "model_type", None) in _BIDIRECTIONAL_IMAGES
    )


def encoder_cache_slots(
    hf_config: Any, max_num_batched_tokens: int, processor_config: dict | None = None
) -> int:
    """Image slots of the encoder cache: a full step's worth of images, plus two (a
    chunk may start and end inside an image), at least MIN_ENCODER_SLOTS. A slot holds
    the most tokens one image can become."""
    per_image = tokens_per_image(hf_config, processor_config)
    if per_image is None:
        return 0
    return max(MIN_ENCODER_SLOTS, -(-max_num_batched_tokens // per_image) + 2)


def encoder_pool_bytes(
    hf_config: Any,
    max_num_batched_tokens: int,
    itemsize: int,
    processor_config: dict | None = None,
) -> int:
    """Bytes of the encoder cache's device pool on each device (it is replicated): one
    scratch row and each slot's image tokens, of the model's hidden width (0: no images)."""
    slots = encoder_cache_slots(hf_config, max_num_batched_tokens, processor_config)
    if not slots:
        return 0
    rows = 1 + slots * tokens_per_image(hf_config, processor_config)
    return rows * hf_config.hidden_size * itemsize


def images_in_one_step(config: Any) -> bool:
    """Whether each image's tokens must be prefilled in one step (bidirectional images);
    raises when a step's token budget cannot hold one image."""
    hf_config = config.model_config.hf_config
    if not bidirectional_images(hf_config):
        return False
    per_image = tokens_per_image(hf_config)
    sched = config.scheduler_config
    for name in ("max_num_batched_tokens", "long_prefill_token_threshold"):
        value = getattr(sched, name, None)
        if value and value < per_image:
            raise ValueError(
                f"{name}={value} is too small for {hf_config.model_type}: its images attend "
                f"both ways, so a step must hold one image's {per_image} tokens (allowed: "
                f">= {per_image})"
            )
    return True
