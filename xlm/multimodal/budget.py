"""How much encoder output the engine holds: the device encoder cache's image slots.

The runner keeps encoder embeddings in a device pool of fixed slots (each holds one
image's tokens); the scheduler lets a step cover the placeholders of at most that many
distinct images, so the images a step reads always fit the pool at once.
"""

from __future__ import annotations

import json
import os
from typing import Any

# The least slots, so a few images are reused across requests even with a small budget.
MIN_ENCODER_SLOTS = 4
# Models whose images become a varying number of tokens (M-RoPE, patch-count buckets).
QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def read_preprocessor_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's preprocessor_config.json (an empty dict when it has none)."""
    path = os.path.join(model_dir or "", "preprocessor_config.json")
    if not model_dir or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def qwen2_vl_pixel_limits(config: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen2-VL preprocessor config (either spelling)."""
    size = config.get("size") or {}
    low = config.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    high = config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    return int(low), int(high)


def qwen2_vl_max_tokens(model_dir: str) -> tuple[int, int]:
    """(min_pixels, the most tokens one image becomes) from a Qwen2-VL checkpoint."""
    config = read_preprocessor_config(model_dir)
    low, high = qwen2_vl_pixel_limits(config)
    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    return low, max(high // factor**2, 1)


def tokens_per_image(hf_config: Any, model_dir: str = "") -> int | None:
    """The most placeholder tokens one image becomes for this model (None: no images)."""
    vision = getattr(hf_config, "vision_config", None)
    model_type = getattr(hf_config, "model_type", None)
    if vision is None:
        return None
    if model_type in QWEN2_VL_TYPES:
        return qwen2_vl_max_tokens(model_dir)[1]
    if model_type != "llava":
        return None
    full = getattr(hf_config, "vision_feature_select_strategy", "default") == "full"
    return (vision.image_size // vision.patch_size) ** 2 + int(full)


def encoder_cache_slots(hf_config: Any, max_num_batched_tokens: int, model_dir: str = "") -> int:
    """Image slots of the encoder cache: a full step's worth of images, plus two (a
    chunk may start and end inside an image), at least MIN_ENCODER_SLOTS. A slot holds
    the most tokens one image can become."""
    per_image = tokens_per_image(hf_config, model_dir)
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
