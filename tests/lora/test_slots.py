"""LoRASlots: adapters on the host (least recently used dropped past max_cpu_loras, never
one in use) and in the device slots (filled in the step's order, the least recently used
one no request of the step needs overwritten), checked against the adapters' own tensors.
The engine's outputs with adapters: tests/lora/test_lora_engine.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from xlm.config import LoRAConfig, ModelConfig, XlmConfig
from xlm.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRASpec
from xlm.lora.request import LoRARequest
from xlm.lora.slots import LoRASlots

RANK = 4
PROJ = "model.layers.0.self_attn.o_proj"  # 64 -> 64 in the tiny llama
OTHER = "model.layers.1.self_attn.q_proj"  # adapted by no adapter here


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from xlm.models.loader import get_model

    config = XlmConfig(
        ModelConfig(model=tiny_checkpoint("llama"), load_format="dummy"),
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=RANK),
    )
    return get_model(config)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[int, tuple[str, np.ndarray, np.ndarray]]:
    """Adapter id -> (PEFT directory, A [r, in], B [out, r]) of o_proj, alpha = 2r."""
    root = tmp_path_factory.mktemp("slot_adapters")
    made = {}
    for i, r in ((1, 2), (2, 4), (3, 3), (4, 1)):
        rng = np.random.default_rng(i)
        a = rng.standard_normal((r, 64)).astype(np.float32)
        b = rng.standard_normal((64, r)).astype(np.float32)
        path = str(root / f"a{i}")
        os.makedirs(path)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}, f)
        prefix = f"base_model.model.{PROJ}"
        save_file(
            {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b},
            os.path.join(path, WEIGHTS_FILE),
        )
        made[i] = (path, a, b)
    return made


def _slots(model, max_loras=2, max_cpu_loras=None) -> LoRASlots:
    config = LoRAConfig(max_loras=max_loras, max_lora_rank=RANK, max_cpu_loras=max_cpu_loras)
    return LoRASlots(nnx.state(model), LoRASpec.of(model, RANK), config)


def _request(adapters, i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, adapters[i][0])


def _device(model, path: str) -> tuple[np.ndarray, np.ndarray]:
    """A [in, slots, R] and B [slots, R, out] of a projection as the step programs read them."""
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}
    return np.asarray(flat[f"{path}.lora_a"].get_value()), np.asarray(
        flat[f"{path}.lora_b"].get_value()
    )


def _assert_in_slot(model, adapters, i: int, slot: int) -> None:
    _, a, b = adapters[i]
    r = a.shape[0]
    dev_a, dev_b = _device(model, PROJ)
    np.testing.assert_allclose(dev_a[:, slot - 1, :r], a.T, rtol=1e-6)
    np.testing.assert_allclose(dev_b[slot - 1, :r], b.T * 2.0, rtol=1e-6)  # alpha / r = 2
    assert not dev_a[:, slot - 1, r:].any() and not dev_b[slot - 1, r:].any()  # rank padding
    other_a, other_b = _device(model, OTHER)
    assert not other_a[:, slot - 1].any() and not other_b[slot - 1].any()


def test_slots_fill_in_step_order_and_evict_the_least_recently_used(model, adapters):
    slots = _slots(model)
    one, two, three = (_request(adapters, i) for i in (1, 2, 3))
    np.testing.assert_array_equal(slots.slots_for([three, None, one, three]), [1, 0, 2, 1])
    _assert_in_slot(model, adapters, 3, 1)
    _assert_in_slot(model, adapters, 1, 2)
    assert slots.num_slot_writes == 2
    np.testing.assert_array_equal(slots.slots_for([one]), [2])  # resident: no write
    assert slots.num_slot_writes == 2
    # Adapter 3 is now the least recently used: adapter 2 takes its slot.
    np.testing.assert_array_equal(slots.slots_for([two, one]), [1, 2])
    _assert_in_slot(model, adapters, 2, 1)
    _assert_in_slot(model, adapters, 1, 2)
    assert slots.num_slot_writes == 3
    with pytest.raises(RuntimeError, match="a step uses 3 adapters but max_loras=2"):
        slots.slots_for([one, two, three])


def test_an_id_named_with_another_directory_is_another_adapter(model, adapters):
    slots = _slots(model)
    slots.slots_for([_request(adapters, 1)])
    renamed = LoRARequest("adapter-1", 1, adapters[2][0])  # id 1, adapter 2's tensors
    np.testing.assert_array_equal(slots.slots_for([renamed]), [2])
    _assert_in_slot(model, adapters, 2, 2)
    assert slots.host[1].rank == 4 and slots.list() == [1]


def test_the_host_cache_drops_the_least_recently_used_adapter_not_in_use(model, adapters):
    slots = _slots(model, max_loras=1, max_cpu_loras=2)
    for i in (1, 2, 3):
        slots.add(_request(adapters, i))
    assert list(slots.host) == [2, 3] and slots.list() == [1, 2, 3]  # 1 is read again later
    slots.acquire(_request(adapters, 2))  # a request uses adapter 2: it stays
    slots.add(_request(adapters, 4))
    slots.add(_request(adapters, 1))
    assert list(slots.host) == [2, 1]
    np.testing.assert_array_equal(slots.slots_for([_request(adapters, 3)]), [1])
    _assert_in_slot(model, adapters, 3, 1)  # read again from its directory


def test_remove_waits_for_the_adapters_last_request(model, adapters):
    slots = _slots(model)
    one, two = _request(adapters, 1), _request(adapters, 2)
    slots.acquire(one)
    slots.acquire(one)
    slots.acquire(two)
    assert slots.live == {1: 2, 2: 1}
    assert slots.remove(1) and slots.list() == [2] and 1 in slots.host  # deferred
    assert not slots.remove(1) and not slots.remove(99)
    slots.release(1)
    assert 1 in slots.host
    slots.release(1)
    assert 1 not in slots.host and 1 not in slots.live
    slots.release(2)
    assert slots.remove(2) and slots.list() == [] and not slots.host
