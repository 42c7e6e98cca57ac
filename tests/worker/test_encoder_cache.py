"""The encoder cache's bookkeeping: slots by content hash, LRU reuse that never evicts an
image the step reads, each token's pool row, hits and misses, image-count buckets."""

from __future__ import annotations

import numpy as np
import pytest

from xlm.multimodal.inputs import MultiModalFeature
from xlm.worker.encoder_cache import (
    EncoderCache,
    EncoderRunner,
    ImageCountLayout,
    image_count_buckets,
)


def _feature(identifier: str, offset: int, length: int = 4) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length, np.zeros((3, 2, 2), np.float32))


def test_buckets_are_powers_of_two_up_to_the_slots():
    assert image_count_buckets(6) == (1, 2, 4, 6)
    assert image_count_buckets(4) == (1, 2, 4)
    assert image_count_buckets(1) == (1,)


def test_lru_reuse_skips_pinned_images():
    cache = EncoderCache(slots=2, tokens_per_image=4)
    assert cache.num_rows == 9 and cache.base_row(1) == 5  # row 0 is the scratch row
    a = cache.assign("a", set())
    b = cache.assign("b", set())
    assert {a, b} == {0, 1}
    cache.lookup("a")  # a is now the most recent: b goes first
    assert cache.assign("c", set()) == b and "b" not in cache.slot_of
    assert cache.assign("d", {"a"}) == cache.slot_of["d"] and "c" not in cache.slot_of
    with pytest.raises(RuntimeError, match="all read by this step"):
        cache.assign("e", {"a", "d"})


def _runner(slots: int = 4) -> EncoderRunner:
    runner = EncoderRunner.__new__(EncoderRunner)  # bookkeeping only: no model, no program
    runner.cache = EncoderCache(slots, tokens_per_image=4)
    return runner


def test_step_rows_map_placeholders_to_pool_rows():
    runner = _runner()
    # Request 0 computes positions 2..7 (its image at 3..6); request 1 positions 0..1,
    # cut inside its image at 1..4.
    features = [[_feature("x", 3)], [_feature("y", 1)]]
    rows, to_encode = runner.step_rows(features, np.array([2, 0]), np.array([6, 2]), 12)
    base_x = runner.cache.base_row(runner.cache.slot_of["x"])
    base_y = runner.cache.base_row(runner.cache.slot_of["y"])
    want = np.zeros(12, np.int32)
    want[1:5] = base_x + np.arange(4)  # tokens 1..4 are positions 3..6
    want[7] = base_y  # request 1's token 1 is position 1, its image's first token
    np.testing.assert_array_equal(rows, want)
    assert [f.identifier for f, _ in to_encode] == ["x", "y"]
    assert (runner.cache.misses, runner.cache.hits) == (2, 0)
    # The next chunk of request 1 reads y from the cache: a hit, nothing to encode.
    rows, to_encode = runner.step_rows([[_feature("y", 1)]], np.array([2]), np.array([4]), 4)
    np.testing.assert_array_equal(rows, [base_y + 1, base_y + 2, base_y + 3, 0])
    assert to_encode == [] and (runner.cache.misses, runner.cache.hits) == (2, 1)


def test_text_requests_read_no_rows():
    runner = _runner()
    rows, to_encode = runner.step_rows([None, []], np.array([0, 5]), np.array([3, 1]), 8)
    assert not rows.any() and to_encode == []


def test_image_count_layout_pads_to_the_bucket():
    layout = ImageCountLayout(5, (3, 2, 2), 4)
    assert layout.take([object()] * 3) == (4, 3)
    assert layout.take([object()] * 7) == (5, 5)
    feature = MultiModalFeature("image", "a", 0, 4, np.ones((3, 2, 2), np.float32))
    inputs, rows = layout.arrays(2, [(feature, 9)])
    assert inputs["pixel_values"].shape == (2, 3, 2, 2)
    assert inputs["pixel_values"][1].sum() == 0  # the padding image
    np.testing.assert_array_equal(rows, [[9, 10, 11, 12], [0, 0, 0, 0]])
