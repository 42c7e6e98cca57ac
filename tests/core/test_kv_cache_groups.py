"""KV cache groups by window: equal-size groups, shared arrays, block bounds."""

from __future__ import annotations

from xlm.core.kv_cache_groups import (
    KVCacheGroupSpec,
    blocks_for_request,
    group_layers,
    layer_placement,
    num_kv_cache_arrays,
    window_block_bound,
)


def test_gemma3_1b_layers_split_into_equal_groups():
    # 26 layers, every sixth global (Gemma 3 1B): 4 global, 22 local.
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    groups = group_layers(windows)
    assert groups[0] == KVCacheGroupSpec(None, (5, 11, 17, 23))
    assert [len(g.layer_ids) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert all(g.sliding_window == 512 for g in groups[1:])
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(26))
    assert num_kv_cache_arrays(groups) == 4
    place = layer_placement(groups)
    assert place[5] == (0, 0) and place[23] == (0, 3) and place[0] == (1, 0) and place[25] == (6, 1)
    # Gemma 2: alternating; one window everywhere: one group of all layers.
    assert group_layers([8, None, 8, None]) == [
        KVCacheGroupSpec(None, (1, 3)),
        KVCacheGroupSpec(8, (0, 2)),
    ]
    assert group_layers([8, 8, 8]) == [KVCacheGroupSpec(8, (0, 1, 2))]
    assert group_layers([]) == [] and num_kv_cache_arrays([]) == 0


def test_window_bound_counts_the_window_and_one_steps_tokens():
    # Window 6, blocks of 4: a decode step sees 5 past tokens + itself over at most 3 blocks.
    assert window_block_bound(6, 4, 1) == 3
    # A step of 8 new tokens reaches back 5 tokens before its first: 13 positions, 5 blocks.
    assert window_block_bound(6, 4, 8) == 5


def test_blocks_for_request_caps_only_windowed_groups():
    groups = [KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(6, (0,))]
    # 40 tokens: 10 blocks for full attention, the window's 5 (steps of <= 8).
    assert blocks_for_request(groups, 40, 4, 8) == 10 + 5
    # Shorter than the window's bound: the windowed group needs only the request's blocks.
    assert blocks_for_request(groups, 8, 4, 8) == 2 + 2
