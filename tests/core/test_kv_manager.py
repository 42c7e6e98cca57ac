"""Both KV managers implement the one interface the scheduler types against."""

from __future__ import annotations

import inspect

import pytest

from tests.core.sim import make_request
from xlm.core.hybrid_kv_cache_manager import HybridKVCacheManager, make_kv_cache_manager
from xlm.core.kv_cache_groups import KVCacheGroupSpec
from xlm.core.kv_cache_manager import KVCacheManager
from xlm.core.kv_manager import KVManager

BS = 4
GROUPS = {
    "single": None,
    "hybrid": [KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(6, (0,))],
}


def protocol_members() -> list[str]:
    return [
        name
        for name, value in vars(KVManager).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]


@pytest.mark.parametrize("cls", [KVCacheManager, HybridKVCacheManager])
def test_each_manager_defines_every_member_itself(cls):
    # Inheriting the Protocol's `...` stub would silently return None: each member must be
    # the manager's own, with the interface's parameter names.
    for name in protocol_members():
        own = getattr(cls, name)
        assert own is not vars(KVManager)[name], f"{cls.__name__}.{name} is the stub"
        if callable(own):
            want = list(inspect.signature(vars(KVManager)[name]).parameters)
            assert list(inspect.signature(own).parameters) == want, (cls.__name__, name)


@pytest.mark.parametrize("kind", GROUPS)
def test_scheduler_calls_work_through_the_interface(kind):
    kv: KVManager = make_kv_cache_manager(GROUPS[kind], 32, BS, 64, True, max_num_batched_tokens=8)
    assert isinstance(kv, KVManager)
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
