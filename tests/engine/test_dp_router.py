"""The data-parallel router on its own: load, prefix affinity by the ranks' KV events (the
longest cached prefix wins; an eviction ends the affinity), the first-block record before
events arrive or without events, and a dead rank."""

from __future__ import annotations

import pytest

from tests.core.sim import make_request
from tests.engine.fake_core import FakeRequest
from xlm.core.kv_cache_utils import update_block_hashes
from xlm.engine.dp_router import DataParallelRouter, PromptBlocks
from xlm.engine.exceptions import EngineDeadError
from xlm.engine.kv_events_subscriber import PrefixCacheIndex

BS = 4


def _req(request_id: str, tokens: list[int], **kw) -> FakeRequest:
    return FakeRequest(request_id, tokens, **kw)


def test_router_balances_load_and_rotates_ties():
    router = DataParallelRouter(2, block_size=BS, slack=2)
    # Short prompts (no full block) go to the least loaded rank, ties alternating.
    ranks = [router.choose(_req(f"r{i}", [i])) for i in range(4)]
    assert ranks == [0, 1, 0, 1] and router.loads == [2, 2]
    router.finish("r0")
    router.finish("r2")
    assert router.choose(_req("r4", [9])) == 0  # the less loaded one
    router.finish("unknown")  # finishing twice or an unknown id changes nothing
    assert router.loads == [1, 2]


def test_router_sends_a_repeated_first_block_where_it_went_until_too_busy():
    router = DataParallelRouter(2, block_size=BS, slack=2)
    prefix = [5, 6, 7, 8]
    first = router.choose(_req("a", [*prefix, 1]))
    # The same first block goes to `first` while it is at most `slack` busier.
    assert [router.choose(_req(f"p{i}", [*prefix, i])) for i in range(2)] == [first, first]
    assert router.loads[first] == 3 and router.loads[1 - first] == 0
    # Three more in flight than the other rank: the prefix moves to the idle rank.
    assert router.choose(_req("moved", [*prefix, 9])) == 1 - first
    assert router.choose(_req("follows", [*prefix, 10])) == 1 - first
    # The salt is part of the key (a salted prompt never shares the unsalted cache).
    salted = _req("salted", [*prefix, 1])
    salted.cache_salt = "s"
    assert router.prefix_key(salted) != router.prefix_key(_req("x", [*prefix, 1]))
    assert router.prefix_key(_req("short", prefix[:3])) is None


def test_router_marks_a_rank_dead_and_returns_its_requests():
    router = DataParallelRouter(2, block_size=BS, slack=2)
    for i in range(4):
        router.choose(_req(f"r{i}", [i]))
    assert sorted(router.mark_dead(1)) == ["r1", "r3"]
    assert [router.choose(_req(f"n{i}", [1, 2, 3, 4])) for i in range(3)] == [0, 0, 0]
    router.mark_dead(0)
    with pytest.raises(EngineDeadError, match="every data-parallel engine is dead"):
        router.choose(_req("none", [1]))


def _hashes(tokens: list[int], n: int) -> list[bytes]:
    """The engine's own block hashes of a prompt (a core Request, as the scheduler hashes)."""
    return list(update_block_hashes(make_request("ref", tokens), BS, n))


def _stored(hashes: list[bytes]) -> list:
    return [["BlockStored", hashes, None, [], BS, None, None, None]]


def test_prompt_blocks_hash_as_the_engine_does():
    tokens = list(range(10, 23))
    blocks = PromptBlocks(_req("a", tokens), BS)
    assert blocks.num_full_blocks == 3
    assert [blocks.hash_at(i) for i in range(3)] == _hashes(tokens, 3)
    salted = _req("s", tokens)
    salted.cache_salt = "salt"
    want = update_block_hashes(make_request("r", tokens, cache_salt="salt"), BS, 1)
    assert PromptBlocks(salted, BS).hash_at(0) == want[0] != blocks.hash_at(0)


def test_events_send_a_prompt_to_the_rank_with_the_longest_cached_prefix():
    index = PrefixCacheIndex(3)
    router = DataParallelRouter(3, BS, slack=2, prefix_index=index)
    prompt = list(range(100, 113))  # three full blocks
    h = _hashes(prompt, 3)
    index.apply(0, _stored(h[:1]))
    index.apply(2, _stored(h[:2]))
    index.apply(1, _stored(h[1:3]))  # not a prefix: its first block is missing
    assert router.choose(_req("a", prompt)) == 2
    assert router.choose(_req("b", prompt)) == 2  # one more in flight there: within slack
    # A prompt sharing only the first block: ranks 0 and 2 hold it; the less loaded wins.
    assert router.choose(_req("c", [*prompt[:BS], 1, 2, 3, 4, 5])) == 0


def test_eviction_events_remove_the_affinity():
    index = PrefixCacheIndex(2)
    router = DataParallelRouter(2, BS, slack=2, prefix_index=index)
    prompt = list(range(200, 209))
    h = _hashes(prompt, 2)
    index.apply(1, _stored(h))
    busy = router.choose(_req("busy", [7]))  # rank 0: the least loaded, ties from 0
    assert busy == 0 and router.choose(_req("a", prompt)) == 1
    router.finish("a")
    # Evicted from rank 1: the prefix attracts nothing there; the least loaded rank gets it.
    index.apply(1, [["BlockRemoved", h, None]])
    assert index.num_blocks(1) == 0
    assert router.choose(_req("b", prompt)) == 1  # least loaded (rank 0 runs `busy`)
    router.finish("b")
    router.finish("busy")
    index.apply(1, _stored(h))
    index.apply(0, [["AllBlocksCleared"]])
    router.choose(_req("busy1", [7]))  # one request on rank 0 ...
    router.choose(_req("busy2", [8]))  # ... and one on rank 1
    assert router.choose(_req("c", prompt)) == 1
    router.finish("c")
    index.apply(1, [["AllBlocksCleared"]])
    router.finish("busy1")  # rank 0 idle, rank 1 runs busy2: no affinity left for rank 1
    assert router.choose(_req("d", prompt)) == 0


def test_two_kv_cache_groups_keep_a_block_until_both_removed_it():
    index = PrefixCacheIndex(1)
    h = _hashes(list(range(4)), 1)
    index.apply(0, _stored(h) + _stored(h))  # the full-attention and the windowed group
    index.apply(0, [["BlockRemoved", h, None]])  # the windowed group's copy went
    assert index.longest_prefix(lambda i: h[i], 1, [0]) == ({0}, 1)
    index.apply(0, [["BlockRemoved", h, None]])
    assert index.longest_prefix(lambda i: h[i], 1, [0]) == (set(), 0)


def test_before_events_arrive_the_first_block_record_bridges_while_in_flight():
    router = DataParallelRouter(2, BS, slack=2, prefix_index=PrefixCacheIndex(2))
    prompt = list(range(300, 309))
    first = router.choose(_req("a", prompt))
    assert router.choose(_req("b", [*prompt[:BS], 9])) == first  # same first block
    router.finish("a")
    router.finish("b")
    # No request in flight and no event: the record is gone, only load decides.
    assert not router.prefix_rank
    router.choose(_req("x", [1]))
    assert router.choose(_req("c", prompt)) != router.rank_of("x")


def test_a_dead_rank_leaves_the_index():
    index = PrefixCacheIndex(2)
    router = DataParallelRouter(2, BS, slack=2, prefix_index=index)
    prompt = list(range(400, 405))
    index.apply(1, _stored(_hashes(prompt, 1)))
    router.mark_dead(1)
    assert index.num_blocks(1) == 0 and router.choose(_req("a", prompt)) == 0
