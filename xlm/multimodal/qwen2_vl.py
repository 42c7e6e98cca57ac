"""Qwen2-VL / Qwen2.5-VL's image processor on the host (numpy + Pillow).

The processor follows the checkpoint's preprocessor_config.json as transformers'
Qwen2VLImageProcessor does: smart_resize to multiples of patch_size * merge_size within
[min_pixels, max_pixels], rescale, normalize, repeat the frame temporal_patch_size times
and flatten into patches [grid_h * grid_w, C * T * p * p], grouped by 2x2 merge block.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from xlm.engine.exceptions import RequestValidationError
from xlm.multimodal.processor_config import qwen2_vl_pixel_limits

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple:
    """(height, width) divisible by `factor`, within [min_pixels, max_pixels], the aspect
    ratio kept as closely as possible (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise RequestValidationError(
            f"image of {width}x{height} has an aspect ratio over 200: allowed at most 200",
            "image",
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImagePreprocessor:
    """Qwen2-VL preprocessing from a preprocessor_config.json dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.min_pixels, self.max_pixels = qwen2_vl_pixel_limits(config)
        self.patch_size = int(config.get("patch_size", 14))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.do_resize = config.get("do_resize", True)
        self.resample = int(config.get("resample", 3))  # bicubic
        self.do_rescale = config.get("do_rescale", True)
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.do_normalize = config.get("do_normalize", True)
        self.mean = np.asarray(config.get("image_mean", _CLIP_MEAN), np.float32)
        self.std = np.asarray(config.get("image_std", _CLIP_STD), np.float32)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def max_tokens(self) -> int:
        """The most merged tokens one image becomes (max_pixels' worth)."""
        return max(self.max_pixels // self.factor**2, 1)

    def __call__(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB PIL image -> (patches [h * w, C * T * p * p] float32, grid (1, h, w))."""
        if self.do_resize:
            new_h, new_w = smart_resize(
                image.height, image.width, self.factor, self.min_pixels, self.max_pixels
            )
            image = image.resize((new_w, new_h), resample=self.resample)
        pixels = np.asarray(image, dtype=np.float32)
        if self.do_rescale:
            pixels = pixels * np.float32(self.rescale_factor)
        if self.do_normalize:
            pixels = (pixels - self.mean) / self.std
        pixels = pixels.transpose(2, 0, 1)  # [C, H, W]
        c, height, width = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        x = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), np.float32), (1, gh, gw)
