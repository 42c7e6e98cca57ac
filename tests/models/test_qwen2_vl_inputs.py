"""Qwen2-VL's host-side step inputs: M-RoPE positions equal transformers' get_rope_index
(prompt and decode tokens, any range of them), and images packed into patch buckets."""

from __future__ import annotations

import numpy as np

from xlm.models.qwen2_vl_inputs import PatchCountLayout, mrope_positions, patch_buckets
from xlm.multimodal.inputs import MultiModalFeature


def _feature(offset: int, grid: tuple[int, int, int], key: str = "a") -> MultiModalFeature:
    n = grid[0] * grid[1] * grid[2]
    return MultiModalFeature("image", key, offset, n // 4, np.zeros((n, 96), np.float32), grid)


def _transformers_positions(ids: list[int], grids: list, image_token: int) -> tuple:
    import torch
    from transformers import Qwen2VLModel

    from tests.qwen2_vl_fixtures import _configs

    config = _configs(False)
    model = Qwen2VLModel(config)
    pos, delta = model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([[int(t == image_token) for t in ids]]),
        image_grid_thw=torch.tensor(grids),
    )
    return pos[:, 0].numpy(), int(delta[0, 0])


def test_positions_equal_get_rope_index():
    token = 7
    grids = [(1, 6, 8), (1, 4, 2)]
    ids = [1, 2] + [token] * 12 + [3, 4, 5] + [token] * 2 + [6]
    features = [_feature(2, grids[0], "a"), _feature(17, grids[1], "b")]
    want, delta = _transformers_positions(ids, grids, token)
    np.testing.assert_array_equal(mrope_positions(features, 0, len(ids), 2), want)
    # Any sub-range (a chunk of a chunked prefill) is the same slice.
    np.testing.assert_array_equal(mrope_positions(features, 5, 18, 2), want[:, 5:18])
    # Decode tokens: their index plus transformers' rope delta, on all three streams.
    decode = mrope_positions(features, len(ids), len(ids) + 3, 2)
    expect = np.arange(len(ids), len(ids) + 3) + delta
    np.testing.assert_array_equal(decode, np.stack([expect] * 3))


def test_text_only_positions_are_plain():
    np.testing.assert_array_equal(mrope_positions(None, 3, 6, 2), np.stack([np.arange(3, 6)] * 3))


def test_patch_buckets():
    assert patch_buckets(16, 144) == (16, 32, 64, 128, 144)
    assert patch_buckets(4, 16) == (16,)


class _Vision:
    spatial_merge_size = 2
    patch_size = 4
    in_channels = 3
    temporal_patch_size = 2
    window_size = 16


def test_layout_packs_images_and_masks_padding():
    layout = PatchCountLayout(_Vision(), 256, 36)
    assert layout.buckets == (16, 32, 64, 128, 144)
    a, b = _feature(0, (1, 4, 4), "a"), _feature(0, (1, 6, 8), "b")
    bucket, n = layout.take([a, b])
    assert (bucket, n) == (64, 2)  # 16 + 48 patches
    inputs, rows = layout.arrays(bucket, [(a, 1), (b, 100)])
    np.testing.assert_array_equal(rows[:4], 1 + np.arange(4))
    np.testing.assert_array_equal(rows[4:16], 100 + np.arange(12))
    assert (inputs["seg"][:16] == 0).all() and (inputs["seg"][16:] == 1).all()
    # Windows of 2x2 merged tokens: b's 3x4 merged grid has 2 x 2 windows.
    assert len(set(inputs["win"][16:].tolist())) == 4
    assert set(inputs["win"][:16].tolist()).isdisjoint(inputs["win"][16:].tolist())
    big = _feature(0, (1, 12, 12), "c")  # 144 patches: the largest bucket, alone
    assert layout.take([big, a]) == (144, 1)
