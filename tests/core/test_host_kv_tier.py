"""The host KV tier's index (LRU, byte cap, per-step rules) and the scheduler over it: the
fake runner copies blocks as the transfers say and checks every K/V read, so a wrong load,
a save after the block was overwritten or a recomputed host hit fails here."""

import random

import pytest

from tests.core.sim import FakeModelRunner, make_request, reference_generate, run_to_completion
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.async_scheduler import AsyncScheduler
from xlm.core.host_kv_tier import HostKVTier
from xlm.core.kv_cache_groups import KVCacheGroupSpec
from xlm.core.scheduler import Scheduler

BS = 4


def test_lru_keeps_the_cap_and_evicts_the_oldest():
    tier = HostKVTier(num_slots=3, block_bytes=100)
    for i in range(5):
        tier.save(f"h{i}", block_id=i + 1)
        tier.take_transfers()
    assert tier.num_used_slots == 3
    assert tier.find(["h0", "h1"], 0, 2) == []
    assert len(tier.find(["h2", "h3", "h4"], 0, 3)) == 3
    assert tier.bytes_to_host == 500


def test_a_hit_refreshes_its_block_in_the_lru():
    tier = HostKVTier(num_slots=2, block_bytes=1)
    tier.save("a", 1)
    tier.save("b", 2)
    tier.take_transfers()
    slots = tier.find(["a"], 0, 1)
    tier.load(["a"], slots, [5])
    tier.take_transfers()
    tier.save("c", 3)  # evicts b, the least recently used
    assert tier.find(["a"], 0, 1) == slots
    assert tier.find(["b"], 0, 1) == []


def test_a_block_saved_this_step_is_loadable_from_the_next():
    tier = HostKVTier(num_slots=4, block_bytes=1)
    tier.save("a", 1)
    assert tier.find(["a"], 0, 1) == []  # its copy to the host is still in flight
    step = tier.take_transfers()
    assert step.save_block_ids == [1] and step.save_slots == [0]
    assert tier.find(["a"], 0, 1) == [0]
    assert tier.take_transfers() is None


def test_a_slot_loaded_this_step_is_not_reused_by_its_saves():
    tier = HostKVTier(num_slots=1, block_bytes=1)
    tier.save("a", 1)
    tier.take_transfers()
    tier.load(["a"], tier.find(["a"], 0, 1), [2])
    tier.save("b", 3)  # the only slot is being read this step: b is not kept
    step = tier.take_transfers()
    assert step.save_slots == [] and step.load_slots == [0]
    assert tier.find(["a"], 0, 1) == [0]


def test_a_slot_found_this_step_is_not_reused_before_it_is_loaded():
    """The allocation between find and load evicts device blocks: their saves must not
    take the slots just found."""
    tier = HostKVTier(num_slots=1, block_bytes=1)
    tier.save("a", 1)
    tier.take_transfers()
    slots = tier.find(["a"], 0, 1)
    tier.save("b", 3)
    tier.load(["a"], slots, [2])
    assert tier.take_transfers().save_slots == []


def test_a_block_computed_this_step_is_not_saved():
    tier = HostKVTier(num_slots=2, block_bytes=1)
    tier.note_computed_this_step(7)
    tier.save("a", 7)
    assert tier.take_transfers() is None and tier.num_used_slots == 0


def test_a_known_block_is_not_saved_twice():
    tier = HostKVTier(num_slots=4, block_bytes=1)
    tier.save("a", 1)
    tier.take_transfers()
    tier.save("a", 2)
    assert tier.take_transfers() is None and tier.num_saved_blocks == 1


def make_sched(
    num_blocks, host_blocks, cls=Scheduler, budget=32, max_seqs=8, max_len=96, windows=None
):
    """`windows`: one KV cache group per window (None: full attention), as Gemma's."""
    sc = SchedulerConfig(budget, max_seqs, max_len, True, 0, "fcfs")
    groups = None if windows is None else [KVCacheGroupSpec(w, (i,)) for i, w in enumerate(windows)]
    cc = CacheConfig(
        block_size=BS, num_host_blocks=host_blocks, host_block_bytes=10, kv_cache_groups=groups
    )
    return cls(sc, cc, num_blocks)


def long_prefix_prompts(n, prefix_len, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(prefix_len)] + [i] for i in range(n)]


def run_pass(sched, runner, prompts, tag, max_tokens=3):
    for i, p in enumerate(prompts):
        sched.add_request(make_request(f"{tag}{i}", p, max_tokens=max_tokens))
    scheduled_before = sched.total_num_scheduled_tokens
    results = run_to_completion(sched, runner)
    return results, sched.total_num_scheduled_tokens - scheduled_before


def test_second_pass_loads_from_the_host_and_recomputes_nothing_it_holds():
    """32 long-prefix requests through a device pool far smaller than their blocks: the
    second pass finds every full block of every prompt in the host tier."""
    prompts = long_prefix_prompts(32, 40)
    for cls in (Scheduler, AsyncScheduler):
        sched = make_sched(num_blocks=40, host_blocks=32 * 10, cls=cls)
        runner = FakeModelRunner(40, BS)
        run_pass(sched, runner, prompts, "a")
        hits_before = sched.host_kv_tier.num_hit_tokens
        device_hits_before = sched.kv_cache_manager.prefix_cache_hits
        results, scheduled = run_pass(sched, runner, prompts, "b")
        full = (41 - 1) // BS * BS  # every full block but the last token's
        for i, p in enumerate(prompts):
            want, _, _ = reference_generate(p, 1000, 96, max_tokens=3)
            assert results[f"b{i}"][0] == want
        # Every full block came from one tier or the other; only the last token and the
        # two decodes of each request were computed.
        host_hits = sched.host_kv_tier.num_hit_tokens - hits_before
        device_hits = sched.kv_cache_manager.prefix_cache_hits - device_hits_before
        assert host_hits > 0 and host_hits + device_hits == 32 * full
        assert scheduled == 32 * (41 - full) + 32 * 2
        stats = sched.make_stats()
        assert stats.host_kv_cache_hits == sched.host_kv_tier.num_hit_tokens
        assert stats.host_kv_bytes_to_device == sched.host_kv_tier.num_loaded_blocks * 10


def test_a_small_host_tier_keeps_its_cap_and_the_outputs():
    prompts = long_prefix_prompts(32, 40, seed=1)
    sched = make_sched(num_blocks=30, host_blocks=25)
    runner = FakeModelRunner(30, BS)
    for tag in "ab":
        results, _ = run_pass(sched, runner, prompts, tag)
        for i, p in enumerate(prompts):
            assert results[f"{tag}{i}"][0] == reference_generate(p, 1000, 96, max_tokens=3)[0]
        assert sched.host_kv_tier.num_used_slots <= 25
        assert len(runner.host) <= 25 and set(runner.host) <= set(range(25))


@pytest.mark.parametrize("windows", [None, [None, 6]], ids=["one-group", "full+window"])
def test_random_mixes_with_a_host_tier_read_only_right_kv(windows):
    rng = random.Random(3)
    shared = [rng.randrange(1000) for _ in range(24)]
    loaded = 0
    for trial in range(10):
        host_blocks = rng.choice([4, 16, 64])
        sched = make_sched(24, host_blocks, budget=16, windows=windows)
        runner = FakeModelRunner(24, BS, group_windows=windows)
        prompts = []
        for _ in range(20):
            tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            prompts.append(shared[: rng.randrange(0, 24)] + tail)
        results, _ = run_pass(sched, runner, prompts + prompts[::-1], f"t{trial}-")
        for i, p in enumerate(prompts + prompts[::-1]):
            assert results[f"t{trial}-{i}"][0] == reference_generate(p, 1000, 96, max_tokens=3)[0]
        loaded += sched.host_kv_tier.num_loaded_blocks
    assert loaded > 0


def test_reset_prefix_cache_clears_the_host_tier():
    sched = make_sched(num_blocks=20, host_blocks=50)
    runner = FakeModelRunner(20, BS)
    run_pass(sched, runner, long_prefix_prompts(8, 30), "a")
    assert sched.host_kv_tier.num_used_slots > 0
    assert sched.reset_prefix_cache()
    assert sched.host_kv_tier.num_used_slots == 0


def test_several_kv_cache_groups_load_every_groups_blocks_from_the_host():
    """Gemma's layout (a full-attention group and a sliding-window group over one pool):
    the second pass loads each group's blocks from the host, reads only right K/V (the fake
    runner checks every in-window read per group) and recomputes nothing the host holds."""
    windows = [None, 6]
    prompts = long_prefix_prompts(16, 40, seed=2)
    for cls in (Scheduler, AsyncScheduler):
        sched = make_sched(num_blocks=60, host_blocks=16 * 2 * 10, cls=cls, windows=windows)
        runner = FakeModelRunner(60, BS, group_windows=windows)
        run_pass(sched, runner, prompts, "a")
        tier = sched.host_kv_tier
        hits_before, loaded_before = tier.num_hit_tokens, tier.num_loaded_blocks
        device_hits_before = sched.kv_cache_manager.prefix_cache_hits
        results, scheduled = run_pass(sched, runner, prompts, "b")
        for i, p in enumerate(prompts):
            assert results[f"b{i}"][0] == reference_generate(p, 1000, 96, max_tokens=3)[0]
        full = (41 - 1) // BS * BS
        host_hits = tier.num_hit_tokens - hits_before
        device_hits = sched.kv_cache_manager.prefix_cache_hits - device_hits_before
        assert host_hits > 0 and host_hits + device_hits == 16 * full
        assert scheduled == 16 * (41 - full) + 16 * 2
        # The full-attention group loads every host hit block; the windowed group only
        # those in its window at the hit's end (2 blocks of 4 for a window of 6 at 40).
        loaded = tier.num_loaded_blocks - loaded_before
        assert host_hits // BS < loaded <= host_hits // BS + 2 * 16
        # The host keys are the groups' keys: (group, hash).
        assert {key[0] for key in tier._slots} == {0, 1}
