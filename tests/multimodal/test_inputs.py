"""MultiModalFeature: which prompt positions an image's placeholders cover."""

import numpy as np

from xlm.multimodal.inputs import MultiModalFeature, features_in_range


def _feature(offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", "h", offset, length, np.zeros((3, 2, 2), np.float32))


def test_overlaps_is_half_open():
    f = _feature(10, 5)  # positions 10..14
    assert f.end == 15
    assert f.overlaps(14, 20) and f.overlaps(0, 11) and f.overlaps(12, 13)
    assert not f.overlaps(15, 20) and not f.overlaps(0, 10)


def test_features_in_range_keeps_prompt_order():
    a, b, c = _feature(0, 4), _feature(8, 4), _feature(20, 4)
    assert features_in_range([a, b, c], 3, 9) == [a, b]
    assert features_in_range(None, 0, 100) == []
