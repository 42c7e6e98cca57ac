"""KV cache groups by window, and the manager that keeps one block table per group."""

from __future__ import annotations

from tests.core.sim import make_request
from xlm.core.hybrid_kv_cache_manager import HybridKVCacheManager, make_kv_cache_manager
from xlm.core.kv_cache_groups import (
    KVCacheGroupSpec,
    group_layers,
    layer_placement,
    num_kv_cache_arrays,
)
from xlm.core.kv_cache_manager import KVCacheManager

BS = 4
W = 6  # window: a query at position p sees p-5..p


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


def manager(num_blocks: int = 40) -> HybridKVCacheManager:
    groups = [KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(W, (0,))]
    kv = make_kv_cache_manager(groups, num_blocks, BS, 64, True, max_num_batched_tokens=8)
    assert isinstance(kv, HybridKVCacheManager)
    return kv


def run(kv, request, steps: list[int]) -> None:
    """Allocate step by step, advancing num_computed_tokens."""
    for n in steps:
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n


def test_window_group_frees_while_full_group_keeps_all():
    kv = manager()
    prompt = list(range(1, 30))
    req = make_request("a", prompt)
    run(kv, req, [8, 8, 8])
    # The third step dropped what a query at 16 cannot see (11..: blocks 0, 1).
    assert kv.num_held_blocks_per_group("a") == [6, 4]
    run(kv, req, [1])  # a query at 24 sees 19..: blocks 4, 5 (and 6 for the new token)
    assert kv.num_held_blocks_per_group("a") == [7, 3]
    assert kv.get_block_ids("a")[1][:4] == [0, 0, 0, 0]
    # Block ids of the two groups never overlap.
    full_ids, window_ids = kv.get_block_ids("a")
    assert not {b for b in full_ids if b} & {b for b in window_ids if b}
    kv.free(req)
    assert kv.usage == 0.0


def test_prefix_hit_needs_full_prefix_but_only_window_blocks():
    kv = manager()
    prompt = list(range(1, 26))  # 25 tokens: a hit can cover 6 full blocks
    a = make_request("a", prompt)
    run(kv, a, [8, 8, 9])
    kv.free(a)
    b = make_request("b", prompt)
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24
    full_hit, window_hit = hit
    assert len(full_hit) == len(window_hit) == 6
    # The windowed group's blocks before the window (query at 24 sees 19..) come back null.
    assert [blk.is_null for blk in window_hit] == [True] * 4 + [False] * 2
    assert all(not blk.is_null for blk in full_hit)
    ids = kv.allocate_slots(b, 1, num_hit, hit)
    assert ids is not None
    assert kv.num_held_blocks_per_group("b") == [7, 3]
    kv.free(b)

    # A full-group block evicted: the hit stops before it for every group.
    c = make_request("c", prompt)
    block = kv.block_pool.cached_block_hash_to_block[(0, b.block_hashes[2])]
    kv.block_pool.free_block_queue.remove(block)
    kv.block_pool.free_block_queue.appendleft(block)
    kv.block_pool.get_new_blocks(1)  # reuses (evicts) it
    hit, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 2 * BS
    # Query at 8 sees 3..: the window group needs blocks 0 and 1.
    assert [len(h) for h in hit] == [2, 2]


def test_allocation_is_all_or_nothing_over_groups():
    kv = manager(num_blocks=6)  # 5 usable
    req = make_request("a", list(range(1, 13)))
    # 12 tokens: 3 blocks in each group = 6 > 5: nothing is taken.
    assert kv.allocate_slots(req, 12) is None
    assert kv.usage == 0.0 and kv.num_held_blocks("a") == 0
    assert kv.allocate_slots(req, 8) is not None  # 2 + 2
    assert kv.num_held_blocks_per_group("a") == [2, 2]


def test_single_group_keeps_the_single_table_manager():
    kv = make_kv_cache_manager([KVCacheGroupSpec(W, (0, 1))], 10, BS, 64, sliding_window=W)
    assert type(kv) is KVCacheManager and kv.sliding_window == W
    assert type(make_kv_cache_manager(None, 10, BS, 64)) is KVCacheManager
