"""BlockPool and its free queue: O(1) links, LRU eviction, lazy eviction, null block."""

import pytest

from tests.core.sim import free_queue_blocks
from xlm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from xlm.core.kv_cache_utils import hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(free_queue_blocks(q)) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(free_queue_blocks(q)) == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert ids(free_queue_blocks(q)) == [0, 1, 3, 4, 2]
    with pytest.raises(RuntimeError):
        q.remove(KVCacheBlock(9))
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    assert free_queue_blocks(q) == [] and q.num_free_blocks == 0


def test_null_block_never_handed_out():
    pool = BlockPool(4)
    assert pool.null_block.is_null and pool.null_block.block_id == 0
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_usage() == 0.0 and pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError):
        BlockPool(1)


def _cache(pool, blocks, tag):
    hashes = [hash_block_tokens(None, [tag, i]) for i in range(len(blocks))]
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks))
    return hashes


def test_lru_eviction_order():
    pool = BlockPool(7)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(3)
    ha = _cache(pool, a, 1)
    hb = _cache(pool, b, 2)
    pool.free_blocks(reversed(a))  # a freed first (tail first), then b
    pool.free_blocks(reversed(b))
    order = ids(free_queue_blocks(pool.free_block_queue))
    assert order == ids(a[::-1]) + ids(b[::-1])
    # Reallocation takes the least recently freed first, evicting exactly those hashes.
    got = pool.get_new_blocks(2)
    assert ids(got) == ids(a[::-1][:2])
    cached = pool.cached_block_hash_to_block
    assert cached.get(ha[2]) is None and cached.get(ha[1]) is None
    assert cached.get(ha[0]) is a[0]
    assert all(cached.get(h) is not None for h in hb)
    assert all(blk.block_hash is None for blk in got)


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    cached = pool.get_new_blocks(2)
    _cache(pool, cached, 3)
    plain = pool.get_new_blocks(2)
    pool.free_blocks(cached)
    pool.free_blocks(plain)
    assert set(ids(pool.get_new_blocks(2))) == set(ids(plain))


def test_touch_takes_cached_free_block_out_of_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks, 5)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3
    hit = pool.cached_block_hash_to_block.get(hashes[1])
    assert hit is blocks[1] and hit.ref_cnt == 0  # lazily kept while free
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert hit not in free_queue_blocks(pool.free_block_queue)
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([hit])
    assert free_queue_blocks(pool.free_block_queue)[-1] is hit


def test_duplicate_content_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.cached_block_hash_to_block.get(h) is a and b.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks, 7)
    assert pool.reset_prefix_cache() is False
    assert pool.cached_block_hash_to_block.get(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, 1)
    assert pool.cached_block_hash_to_block == {}
