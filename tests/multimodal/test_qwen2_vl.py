"""The numpy + Pillow Qwen2-VL image processor equals transformers' (pixel values and
grid_thw) for images of several sizes, smart_resize included."""

from __future__ import annotations

import numpy as np
import pytest

from tests.multimodal_fixtures import make_image
from tests.qwen2_vl_fixtures import MAX_PIXELS, MIN_PIXELS, image_processor
from xlm.engine.exceptions import RequestValidationError
from xlm.multimodal.qwen2_vl import Qwen2VLImagePreprocessor, smart_resize


@pytest.mark.parametrize(
    "size, limits",
    [
        ((40, 33), (MIN_PIXELS, MAX_PIXELS)),  # shrunk to max_pixels
        ((8, 8), (MIN_PIXELS, MAX_PIXELS)),  # grown to min_pixels
        ((90, 20), (MIN_PIXELS, MAX_PIXELS)),
        ((37, 51), (56 * 56, 28 * 28 * 1280)),  # the real checkpoints' limits, patch 14
    ],
)
def test_pixels_and_grid_equal_transformers(size, limits):
    image = make_image(sum(size), *size)
    if limits == (MIN_PIXELS, MAX_PIXELS):
        reference = image_processor(*limits)
    else:
        from transformers import Qwen2VLImageProcessorPil

        reference = Qwen2VLImageProcessorPil()
    want = reference([image], return_tensors="np")
    config = reference.to_dict()
    ours = Qwen2VLImagePreprocessor(config)
    patches, grid = ours(image)
    assert list(grid) == list(want["image_grid_thw"][0])
    np.testing.assert_allclose(patches, want["pixel_values"], atol=1e-5)


def test_legacy_min_max_pixels_keys():
    ours = Qwen2VLImagePreprocessor({"min_pixels": 100, "max_pixels": 5000, "patch_size": 14})
    assert (ours.min_pixels, ours.max_pixels) == (100, 5000)
    assert ours.max_tokens() == 5000 // 28**2


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(RequestValidationError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 56 * 56, 28 * 28 * 1280)
