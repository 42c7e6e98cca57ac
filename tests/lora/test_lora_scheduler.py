"""The scheduler with LoRA: no step's running requests use more adapters than the device
has slots, the others wait their turn in order; block hashes are keyed by adapter."""

from __future__ import annotations

import pytest

from tests.core.sim import FakeModelRunner, check_invariants, make_request
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.kv_cache_utils import update_block_hashes
from xlm.core.scheduler import Scheduler
from xlm.lora.request import LoRARequest

BS = 4
LORAS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)]


def with_lora(request, lora):
    request.lora_request = lora
    return request


def test_running_adapters_never_exceed_max_loras():
    sched = Scheduler(
        SchedulerConfig(64, 8, 128, True, 0, "fcfs"),
        CacheConfig(block_size=BS),
        64,
        max_loras=2,
    )
    runner = FakeModelRunner(64, BS)
    # Adapters 1, 2, 3, 1, None, 3 in arrival order.
    order = [LORAS[0], LORAS[1], LORAS[2], LORAS[0], None, LORAS[2]]
    for i, lora in enumerate(order):
        sched.add_request(with_lora(make_request(f"r{i}", [5 + i] * 6, max_tokens=3), lora))
    first_step = None
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        check_invariants(sched, so)
        running = {r.lora_request.lora_int_id for r in sched.running if r.lora_request}
        assert len(running) <= 2
        if first_step is None:
            first_step = set(so.num_scheduled_tokens)
        sched.update_from_output(so, runner.execute(so))
        steps += 1
        assert steps < 100
    # The third adapter's requests waited; the base model's and adapter 1's second did not.
    assert first_step == {"r0", "r1", "r3", "r4"}


def test_lora_request_refused_when_lora_is_off():
    sched = Scheduler(SchedulerConfig(64, 8, 128, True, 0, "fcfs"), CacheConfig(block_size=BS), 64)
    request = with_lora(make_request("r", [1, 2, 3]), LORAS[0])
    with pytest.raises(ValueError, match="names LoRA adapter 'a1' but LoRA is off"):
        sched.add_request(request)


def test_block_hashes_are_keyed_by_adapter():
    prompt = list(range(12))
    hashes = {}
    for key, lora in (("base", None), ("a1", LORAS[0]), ("a2", LORAS[1]), ("a1 again", LORAS[0])):
        request = with_lora(make_request(key, prompt), lora)
        hashes[key] = update_block_hashes(request, BS, 3)
    assert len({tuple(h) for h in hashes.values()}) == 3
    assert hashes["a1"] == hashes["a1 again"]
    # Every block differs, not only the first (the key reaches them through the chain).
    assert all(a != b for a, b in zip(hashes["a1"], hashes["a2"]))
