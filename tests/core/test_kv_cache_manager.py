"""KVCacheManager: prefix hits, allocation failure, tail-first freeing, counters."""

import pytest

from tests.core.sim import make_request
from xlm.core.kv_cache_manager import KVCacheManager

BS = 4


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
    for b in kv.req_to_blocks["r0"][:3]:
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
    assert "b" not in kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == 1
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
    free_ids = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
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
