"""The preprocessor config the engine runs with: the checkpoint's preprocessor_config.json,
the user's `mm_processor_kwargs` over it, and the engine's cap on Qwen2-VL's max_pixels.

Every place that sizes images (the processor, tokens per image, the encoder cache's
slots and pool, the encoder's patch buckets, `xlm plan`) reads this one dict, so they all
see the same override and the same cap.
"""

from __future__ import annotations

import json
import os
from typing import Any

from xlm.logger import init_logger

logger = init_logger(__name__)

# Models whose images become a varying number of tokens (M-RoPE, patch-count buckets).
QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# transformers' Qwen2VLImageProcessor defaults when the config names no limits.
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280
_QWEN2_VL_KWARGS = ("min_pixels", "max_pixels", "size")
_SIZE_KEYS = ("shortest_edge", "longest_edge")
# model_type -> the mm_processor_kwargs keys its processor takes (vLLM's name for them).
PROCESSOR_KWARGS: dict[str, tuple[str, ...]] = {
    "llava": (),
    "gemma3": ("do_pan_and_scan",),
    **{t: _QWEN2_VL_KWARGS for t in QWEN2_VL_TYPES},
}


def read_preprocessor_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's preprocessor_config.json (an empty dict when it has none)."""
    path = os.path.join(model_dir or "", "preprocessor_config.json")
    if not model_dir or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def qwen2_vl_pixel_limits(config: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen2-VL preprocessor config (either spelling; the
    min_pixels/max_pixels keys win over `size`, as in transformers)."""
    size = config.get("size") or {}
    low = config.get("min_pixels") or size.get("shortest_edge") or QWEN2_VL_MIN_PIXELS
    high = config.get("max_pixels") or size.get("longest_edge") or QWEN2_VL_MAX_PIXELS
    return int(low), int(high)


def qwen2_vl_factor(config: dict[str, Any]) -> int:
    """Pixels on a side of one merged token (patch_size * merge_size)."""
    return int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))


def _with_pixel_limits(config: dict[str, Any], low: int, high: int) -> dict[str, Any]:
    """`config` with its limits written in both spellings (they then agree)."""
    size = {k: v for k, v in (config.get("size") or {}).items() if k not in _SIZE_KEYS}
    size |= {"shortest_edge": low, "longest_edge": high}
    return config | {"min_pixels": low, "max_pixels": high, "size": size}


def _positive(key: str, value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(
            f"mm_processor_kwargs {key}={value!r} is invalid: allowed a positive integer (pixels)"
        )


def check_mm_processor_kwargs(hf_config: Any, kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the key and the allowed ones when `kwargs` has a key the
    model's processor does not take, or a value out of range."""
    model_type = getattr(hf_config, "model_type", None)
    allowed = PROCESSOR_KWARGS.get(model_type)
    if allowed is None or getattr(hf_config, "vision_config", None) is None:
        allowed = ()
    for key, value in kwargs.items():
        if key not in allowed:
            names = ", ".join(allowed) if allowed else "none (the model takes no images)"
            raise ValueError(
                f"mm_processor_kwargs key {key!r} is not an option of {model_type}'s "
                f"processor: allowed {names}"
            )
        if key in ("min_pixels", "max_pixels"):
            _positive(key, value)
        elif key == "size":
            if not isinstance(value, dict) or not value or not set(value) <= set(_SIZE_KEYS):
                raise ValueError(
                    f"mm_processor_kwargs size={value!r} is invalid: allowed a dict with "
                    f"{' and/or '.join(_SIZE_KEYS)} (pixels)"
                )
            for k, v in value.items():
                _positive(f"size.{k}", v)
        elif key == "do_pan_and_scan" and value is not False:
            raise ValueError(
                f"mm_processor_kwargs do_pan_and_scan={value!r} is invalid: xlm does not "
                "apply pan-and-scan (allowed false)"
            )


def apply_mm_processor_kwargs(
    hf_config: Any, config: dict[str, Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint's preprocessor config with the (checked) kwargs over it."""
    check_mm_processor_kwargs(hf_config, kwargs)
    if getattr(hf_config, "model_type", None) not in QWEN2_VL_TYPES:
        return config | kwargs
    low, high = qwen2_vl_pixel_limits(config)
    size = kwargs.get("size") or {}
    low = kwargs.get("min_pixels") or size.get("shortest_edge") or low
    high = kwargs.get("max_pixels") or size.get("longest_edge") or high
    if low > high:
        raise ValueError(
            f"mm_processor_kwargs leaves min_pixels={low} above max_pixels={high} (each "
            "from the kwargs, else the checkpoint's config): allowed min_pixels <= max_pixels"
        )
    return _with_pixel_limits(config, low, high)


def _user_sets_max_pixels(kwargs: dict[str, Any]) -> bool:
    return "max_pixels" in kwargs or "longest_edge" in (kwargs.get("size") or {})


def fit_max_pixels(
    hf_config: Any,
    config: dict[str, Any],
    kwargs: dict[str, Any],
    max_model_len: int,
    max_num_batched_tokens: int,
) -> dict[str, Any]:
    """Qwen2-VL: bound one image's tokens by what the engine holds.

    The encoder's budget is vLLM's default, max_num_batched_tokens (and an image must fit
    in max_model_len). When the user names no max_pixels and the config's largest image
    needs more tokens, max_pixels is lowered to that budget's worth (logged). A max_pixels
    the user names is kept unless its images cannot fit max_model_len (an error).
    """
    if getattr(hf_config, "model_type", None) not in QWEN2_VL_TYPES:
        return config
    low, high = qwen2_vl_pixel_limits(config)
    factor = qwen2_vl_factor(config)
    most = max(high // factor**2, 1)
    if _user_sets_max_pixels(kwargs):
        if most > max_model_len:
            raise ValueError(
                f"mm_processor_kwargs max_pixels={high} lets one image become {most} tokens, "
                f"more than max_model_len={max_model_len} holds: allowed at most "
                f"{max_model_len * factor**2} pixels (max_model_len * {factor}^2)"
            )
        return config
    limit = min(max_model_len, max_num_batched_tokens)
    if most <= limit:
        return config
    capped = limit * factor**2
    if low > capped:
        raise ValueError(
            f"min_pixels={low} makes even the smallest image more than {limit} tokens "
            f"(min(max_model_len={max_model_len}, max_num_batched_tokens="
            f"{max_num_batched_tokens})): raise max_num_batched_tokens or set "
            "mm_processor_kwargs min_pixels / max_pixels"
        )
    logger.info(
        "%s: the processor config's max_pixels=%d makes up to %d tokens an image, more "
        "than the engine's encoder budget of %d tokens (min of max_num_batched_tokens=%d "
        "and max_model_len=%d): images are capped at max_pixels=%d (%d tokens); set "
        "--mm-processor-kwargs '{\"max_pixels\": N}' (or raise --max-num-batched-tokens) to "
        "choose another",
        hf_config.model_type,
        high,
        most,
        limit,
        max_num_batched_tokens,
        max_model_len,
        capped,
        limit,
    )
    return _with_pixel_limits(config, low, capped)


def resolve_processor_config(config: Any) -> dict[str, Any]:
    """The preprocessor config of an XlmConfig's model as the engine runs it: the
    checkpoint's, the mm_processor_kwargs over it, Qwen2-VL's max_pixels fit to the
    engine's budget. Computed once and kept on the ModelConfig."""
    model_config = config.model_config
    if model_config.mm_processor_config is not None:
        return model_config.mm_processor_config
    hf_config = model_config.hf_config
    kwargs = dict(model_config.mm_processor_kwargs or {})
    check_mm_processor_kwargs(hf_config, kwargs)
    if getattr(hf_config, "vision_config", None) is None:
        resolved: dict[str, Any] = {}
    else:
        sched = config.scheduler_config
        resolved = apply_mm_processor_kwargs(
            hf_config, read_preprocessor_config(model_config.model), kwargs
        )
        resolved = fit_max_pixels(
            hf_config, resolved, kwargs, sched.max_model_len, sched.max_num_batched_tokens
        )
    model_config.mm_processor_config = resolved
    return resolved
