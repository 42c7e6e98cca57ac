"""KV cache events recorded by the block pool through the scheduler: BlockStored carries the
blocks' hashes (sha256 chain recomputed here), parent hash, tokens, block size and LoRA;
BlockRemoved the evicted hashes; AllBlocksCleared a reset; the batch round-trips msgpack."""

import random

from tests.core.sim import FakeModelRunner, make_request, run_to_completion
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.kv_cache_utils import hash_block_tokens
from xlm.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_event_batch,
    encode_event_batch,
)
from xlm.core.scheduler import Scheduler
from xlm.lora.request import LoRARequest

BS = 4


def make_sched(num_blocks=64, max_loras=None):
    sc = SchedulerConfig(64, 8, 128, True, 0, "fcfs")
    return Scheduler(
        sc, CacheConfig(block_size=BS), num_blocks, max_loras=max_loras, kv_events=True
    )


def chain(tokens, extra=None):
    hashes, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS], extra if i == 0 else None)
        hashes.append(parent)
    return hashes


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def test_stored_events_carry_the_chain_tokens_and_parent():
    sched = make_sched()
    prompt = [random.Random(0).randrange(1000) for _ in range(10)]
    sched.add_request(make_request("a", prompt, max_tokens=1))
    sched.schedule()
    events = sched.take_kv_events()
    (event,) = stored(events)
    assert event.block_hashes == chain(prompt)  # the two full blocks of ten tokens
    assert event.parent_block_hash is None
    assert event.token_ids == prompt[:8] and event.block_size == BS
    assert event.lora_id is None
    assert sched.take_kv_events() == []  # taken once


def test_a_later_block_names_its_parent_and_a_shared_prefix_is_not_stored_again():
    sched = make_sched()
    runner = FakeModelRunner(64, BS)
    prompt = list(range(100, 109))
    sched.add_request(make_request("a", prompt, max_tokens=6))
    run_to_completion(sched, runner)
    events = stored(sched.take_kv_events())
    hashes = chain(prompt + [0] * 8)[:2]
    assert events[0].block_hashes == hashes
    # The decodes fill the third block: stored alone, its parent the second block.
    assert events[1].parent_block_hash == hashes[1] and len(events[1].block_hashes) == 1
    sched.add_request(make_request("b", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    assert stored(sched.take_kv_events()) == []  # a hit stores nothing


def test_lora_blocks_carry_the_adapter():
    sched = make_sched(max_loras=1)
    lora = LoRARequest("ad", 3, "/nowhere")
    prompt = list(range(50, 58))
    request = make_request("a", prompt, max_tokens=1)
    request.lora_request = lora
    sched.add_request(request)
    sched.schedule()
    (event,) = stored(sched.take_kv_events())
    assert event.lora_id == 3 and event.lora_name == "ad"
    assert event.block_hashes == chain(prompt, tuple(lora.cache_key))


def test_eviction_removes_and_reset_clears():
    sched = make_sched(num_blocks=6)
    runner = FakeModelRunner(6, BS)
    sched.add_request(make_request("a", list(range(200, 212)), max_tokens=1))
    run_to_completion(sched, runner)
    first = chain(list(range(200, 212)))
    sched.take_kv_events()
    sched.add_request(make_request("b", list(range(300, 316)), max_tokens=1))
    run_to_completion(sched, runner)
    removed = [
        h for e in sched.take_kv_events() if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert removed and set(removed) <= set(first)
    assert sched.reset_prefix_cache()
    assert sched.take_kv_events() == [AllBlocksCleared()]


def test_a_batch_round_trips_msgpack():
    events = [
        BlockStored([b"h1", b"h2"], None, [1, 2, 3, 4], 2, 7, None, "x"),
        BlockRemoved([b"h0"]),
    ]
    ts, lists, rank = decode_event_batch(encode_event_batch(events, 1, timestamp=5.0))
    assert (ts, rank) == (5.0, 1)
    assert lists == [
        ["BlockStored", [b"h1", b"h2"], None, [1, 2, 3, 4], 2, 7, None, "x"],
        ["BlockRemoved", [b"h0"], None],
    ]
