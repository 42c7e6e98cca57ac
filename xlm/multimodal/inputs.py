"""What a multimodal request carries to the engine core: one MultiModalFeature per item."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class MultiModalFeature:
    """One image of a prompt: its pixels, its content hash, and the placeholder tokens
    (prompt positions [offset, offset + length)) its encoder embeddings replace."""

    modality: str  # "image"
    identifier: str  # hex sha256 of the processed pixels: the encoder cache's key
    offset: int
    length: int
    pixel_values: np.ndarray  # float32, the family's processor's output ([C, H, W], or
    # Qwen2-VL's patches [h * w, C * T * p * p])
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL: its patch grid (t, h, w)

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.offset + self.length

    def overlaps(self, start: int, stop: int) -> bool:
        """Whether positions [start, stop) cover any of its placeholders."""
        return self.offset < stop and start < self.end


def features_in_range(features: list[Any] | None, start: int, stop: int) -> list[Any]:
    """The features whose placeholders positions [start, stop) cover."""
    return [f for f in features or () if f.overlaps(start, stop)]
