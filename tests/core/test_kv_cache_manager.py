"""KVCacheManager over one or several KV cache groups: prefix hits, allocation, freeing."""

import pytest

from tests.core.sim import free_queue_blocks, make_request
from xlm.core.kv_cache_groups import KVCacheGroupSpec
from xlm.core.kv_cache_manager import KVCacheManager

BS = 4
W = 6  # window: a query at position p sees p-5..p
GROUPS = {
    "single": None,
    "hybrid": [KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(W, (0,))],
}


def admit(kv, req, num_new=None):
    blocks, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    ids = kv.allocate_slots(req, num_new, num_hit, blocks)
    if ids is not None:
        req.num_computed_tokens = num_hit + num_new
    return ids, num_hit


def test_prefix_shared_by_many_requests_is_stored_once_and_hit():
    kv = KVCacheManager(num_blocks=64, block_size=BS, max_model_len=128)
    prefix = list(range(100, 112))  # 3 full blocks
    reqs = [make_request(f"r{i}", prefix + [i, i + 1]) for i in range(10)]
    _, hit0 = admit(kv, reqs[0])
    assert hit0 == 0
    for r in reqs[1:]:
        _, hit = admit(kv, r)
        assert hit == 12
    tables = [kv.get_block_ids(r.request_id) for r in reqs]
    assert all(t[:3] == tables[0][:3] for t in tables)  # one physical copy
    assert len({t[3] for t in tables}) == 10  # private tails
    for b in kv.groups[0].req_to_blocks["r0"][:3]:
        assert b.ref_cnt == 10
    # 3 shared + 10 private blocks in use.
    assert kv.block_pool.get_num_free_blocks() == 63 - 13
    assert kv.prefix_cache_queries == 14 * 10 and kv.prefix_cache_hits == 12 * 9
    for r in reqs:
        kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == 63
    # Still cached after everyone left: a newcomer hits.
    _, hit = admit(kv, make_request("late", prefix + [7]))
    assert hit == 12


def test_never_hits_the_whole_sequence():
    kv = KVCacheManager(16, BS, 64)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    b = make_request("b", list(range(8)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 4 and len(blocks) == 1  # the last token must be recomputed for logits
    c = make_request("c", list(range(9)))
    assert kv.get_computed_blocks(c)[1] == 8


def test_cache_salt_separates_caches():
    kv = KVCacheManager(16, BS, 64)
    admit(kv, make_request("a", list(range(9)), cache_salt="alice"))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_blocks_are_cached_as_soon_as_scheduled_full():
    kv = KVCacheManager(16, BS, 64)
    a = make_request("a", list(range(10)))
    admit(kv, a, num_new=6)  # a chunk: only block 0 is full
    assert kv.get_computed_blocks(make_request("b", list(range(10))))[1] == 4
    kv.allocate_slots(a, 4)
    a.num_computed_tokens += 4
    # Same step: a later request already sees both full blocks.
    assert kv.get_computed_blocks(make_request("c", list(range(10))))[1] == 8


def test_decode_blocks_enter_the_cache():
    kv = KVCacheManager(16, BS, 64)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    for tok in (4, 5, 6):
        a.append_output_token_ids(tok)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert a.num_computed_tokens == 6 and len(a.block_hashes) == 1
    b = make_request("b", [1, 2, 3, 4, 5, 6])
    assert kv.get_computed_blocks(b)[1] == 4


def test_allocate_returns_none_when_out_of_blocks_and_changes_nothing():
    kv = KVCacheManager(5, BS, 64)  # 4 usable blocks
    a = make_request("a", list(range(12)))
    ids, _ = admit(kv, a)
    assert len(ids) == 3
    b = make_request("b", list(range(50, 58)))
    assert kv.allocate_slots(b, 8) is None
    assert "b" not in kv.groups[0].req_to_blocks and kv.block_pool.get_num_free_blocks() == 1
    assert kv.prefix_cache_queries == 12  # a failed admission is not counted
    assert kv.allocate_slots(b, 4) is not None
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 0)


def test_evictable_hit_blocks_are_not_double_counted():
    kv = KVCacheManager(4, BS, 64)  # 3 usable
    a = make_request("a", list(range(9)))
    admit(kv, a)  # 3 blocks
    kv.free(a)
    # b hits 2 free cached blocks and needs 2 more: only 1 other block is free.
    b = make_request("b", list(range(8)) + [99, 98, 97, 96, 95])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert kv.allocate_slots(b, 5, hit, blocks) is None
    assert all(blk.ref_cnt == 0 for blk in blocks)


def test_free_is_tail_first():
    kv = KVCacheManager(16, BS, 64)
    a = make_request("a", list(range(13)))
    admit(kv, a)
    table = kv.get_block_ids("a")
    kv.free(a)
    free_ids = [b.block_id for b in free_queue_blocks(kv.block_pool.free_block_queue)]
    # The tail block is evicted first, the first (most shareable) block last.
    assert free_ids[-3:] == table[2::-1]
    assert kv.get_block_ids("a") == []


def test_can_fit_and_usage():
    kv = KVCacheManager(5, BS, 64)
    assert kv.can_fit(16) and not kv.can_fit(17)
    assert kv.usage == 0.0
    admit(kv, make_request("a", list(range(8))))
    assert kv.usage == 0.5


def test_caching_disabled():
    kv = KVCacheManager(16, BS, 64, enable_caching=False)
    admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache():
    kv = KVCacheManager(16, BS, 64)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


@pytest.mark.parametrize("kind", GROUPS)
def test_the_scheduler_calls_on_one_and_on_several_groups(kind):
    kv = KVCacheManager(32, BS, 64, True, kv_cache_groups=GROUPS[kind], max_num_batched_tokens=8)
    assert kv.can_fit(20) and kv.num_blocks_to_fit(20) <= kv.num_usable_blocks
    assert not kv.can_fit(10_000)
    prompt = list(range(1, 13))  # three full blocks
    a = make_request("a", prompt)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, len(prompt)) is not None
    assert kv.num_held_blocks("a") > 0 and kv.usage > 0
    assert not kv.reset_prefix_cache()  # blocks in use
    a.num_computed_tokens = len(prompt)
    kv.free(a)
    assert kv.usage == 0
    # The same prompt again hits the prefix cache (all but the last block's tokens).
    b = make_request("b", prompt)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    kv.allocate_slots(b, len(prompt) - num_hit, num_hit, blocks)
    ids = kv.get_block_ids("b")
    flat = [i for g in ids for i in g] if kind == "hybrid" else list(ids)
    assert len(set(flat) - {0}) >= 3
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("c", prompt)) == ([], 0)


def hybrid(num_blocks: int = 40) -> KVCacheManager:
    groups = [KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(W, (0,))]
    kv = KVCacheManager(num_blocks, BS, 64, True, kv_cache_groups=groups, max_num_batched_tokens=8)
    assert len(kv.groups) == 2
    return kv


def run(kv, request, steps: list[int]) -> None:
    """Allocate step by step, advancing num_computed_tokens."""
    for n in steps:
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n


def test_window_group_frees_while_full_group_keeps_all():
    kv = hybrid()
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
    kv = hybrid()
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
    kv = hybrid(num_blocks=6)  # 5 usable
    req = make_request("a", list(range(1, 13)))
    # 12 tokens: 3 blocks in each group = 6 > 5: nothing is taken.
    assert kv.allocate_slots(req, 12) is None
    assert kv.usage == 0.0 and kv.num_held_blocks("a") == 0
    assert kv.allocate_slots(req, 8) is not None  # 2 + 2
    assert kv.num_held_blocks_per_group("a") == [2, 2]


def test_single_group_keeps_the_single_table_layout():
    kv = KVCacheManager(10, BS, 64, kv_cache_groups=[KVCacheGroupSpec(W, (0, 1))])
    assert len(kv.groups) == 1 and kv.sliding_window == W
    # One group: block ids are one list (the runner reads a tuple as one list per group).
    assert kv.allocate_slots(make_request("a", list(range(1, 9))), 8) == [1, 2]
    assert kv.get_block_ids("a") == [1, 2]
    assert KVCacheManager(10, BS, 64, sliding_window=W).sliding_window == W
    assert KVCacheManager(10, BS, 64).sliding_window is None
