"""One KV cache group's block tables: window hits, dropping, group-keyed caching."""

from tests.core.sim import make_request
from xlm.core.block_pool import BlockPool
from xlm.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

BS = 4
W = 6  # window: a query at position p sees p-5..p


def group(pool, window=None, group_id=None) -> SingleTypeKVCacheManager:
    return SingleTypeKVCacheManager(pool, BS, True, window, group_id)


def test_a_window_drops_blocks_no_later_query_sees():
    pool = BlockPool(16)
    g = group(pool, W)
    req = make_request("a", list(range(1, 21)))
    assert g.commit_slots(req, 0, 16, None) == [1, 2, 3, 4]
    assert g.num_cached_block["a"] == 4  # full blocks enter the cache at once
    # The next step's query at 16 sees 11..: blocks 0 and 1 are freed, nulls in the table.
    assert not g.fits_without_change("a", 16, 17)
    g.drop_out_of_window("a", 16)
    assert g.get_block_ids("a") == [0, 0, 3, 4] and g.num_held_blocks("a") == 2
    assert pool.get_num_free_blocks() == 15 - 2
    assert g.commit_slots(req, 16, 17, None) == [5]
    assert not g.fits_without_change("a", 17, 18)  # a query at 17 no longer sees block 2
    g.drop_out_of_window("a", 17)
    assert g.get_block_ids("a") == [0, 0, 0, 4, 5] and pool.get_num_free_blocks() == 15 - 2
    assert g.fits_without_change("a", 17, 18)  # no new, newly full or dropped block
    g.free(req)
    assert pool.get_num_free_blocks() == 15 and g.req_to_blocks == {}


def test_window_hit_needs_only_the_blocks_the_next_query_sees():
    pool = BlockPool(16)
    g = group(pool, W)
    a = make_request("a", list(range(1, 26)))
    g.commit_slots(a, 0, 24, None)  # 6 full blocks cached
    hashes = a.block_hashes
    g.free(a)
    hit = g.find_cached_blocks(hashes, 6)
    # A query at 24 sees 19..: blocks 4 and 5; the ones before come back null.
    assert [b.is_null for b in hit] == [True] * 4 + [False] * 2
    # Block 5 evicted: the hit ends at 5 blocks, a query at 20 sees 15..: blocks 3 and 4.
    block5 = hit[5]
    pool.free_block_queue.remove(block5)
    pool.free_block_queue.appendleft(block5)
    pool.get_new_blocks(1)  # reuses (evicts) it
    shorter = g.find_cached_blocks(hashes, 6)
    assert [b.is_null for b in shorter] == [True] * 3 + [False] * 2
    # Block 3 evicted too: the hit ends at 3 blocks, a query at 12 sees 7..: blocks 1, 2.
    pool.free_block_queue.remove(shorter[3])
    pool.free_block_queue.appendleft(shorter[3])
    pool.get_new_blocks(1)
    assert [b.is_null for b in g.find_cached_blocks(hashes, 6)] == [True, False, False]
    # Full attention needs the whole prefix.
    full = group(BlockPool(16))
    b = make_request("b", list(range(1, 26)))
    full.commit_slots(b, 0, 24, None)
    assert len(full.find_cached_blocks(b.block_hashes, 6)) == 6
    assert full.find_cached_blocks(b.block_hashes, 6) == full.find_cached_prefix(b.block_hashes, 6)


def test_groups_key_their_blocks_apart_over_one_pool():
    pool = BlockPool(16)
    g0, g1 = group(pool, None, 0), group(pool, W, 1)
    req = make_request("a", list(range(1, 10)))
    g0.commit_slots(req, 0, 8, None)
    h = req.block_hashes
    assert set(pool.cached_block_hash_to_block) == {(0, h[0]), (0, h[1])}
    # Group 1's layers never computed these tokens: no hit there.
    assert g1.find_cached_blocks(h, 2) == [] and len(g0.find_cached_blocks(h, 2)) == 2
