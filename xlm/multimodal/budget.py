"""How much encoder output the engine holds: the device encoder cache's image slots.

The runner keeps encoder embeddings in a device pool of fixed slots (each holds one
image's tokens); the scheduler lets a step cover the placeholders of at most that many
distinct images, so the images a step reads always fit the pool at once.
"""

from __future__ import annotations

from typing import Any

# The least slots, so a few images are reused across requests even with a small budget.
MIN_ENCODER_SLOTS = 4


def tokens_per_image(hf_config: Any) -> int | None:
    """The most placeholder tokens one image becomes for this model (None: no images)."""
    vision = getattr(hf_config, "vision_config", None)
    if getattr(hf_config, "model_type", None) != "llava" or vision is None:
        return None
    full = getattr(hf_config, "vision_feature_select_strategy", "default") == "full"
    return (vision.image_size // vision.patch_size) ** 2 + int(full)


def encoder_cache_slots(hf_config: Any, max_num_batched_tokens: int) -> int:
    """Image slots of the encoder cache: a full step's worth of images, plus two (a
    chunk may start and end inside an image), at least MIN_ENCODER_SLOTS."""
    per_image = tokens_per_image(hf_config)
    if per_image is None:
        return 0
    return max(MIN_ENCODER_SLOTS, -(-max_num_batched_tokens // per_image) + 2)


def encoder_pool_bytes(hf_config: Any, max_num_batched_tokens: int, itemsize: int) -> int:
    """Bytes of the encoder cache's device pool on each device (it is replicated): one
    scratch row and each slot's image tokens, of the model's hidden width (0: no images)."""
    slots = encoder_cache_slots(hf_config, max_num_batched_tokens)
    if not slots:
        return 0
    rows = 1 + slots * tokens_per_image(hf_config)
    return rows * hf_config.hidden_size * itemsize
