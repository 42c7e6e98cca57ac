"""LoRARequest: its fields checked at construction, its prefix-cache key per adapter."""

from __future__ import annotations

import pytest

from xlm.lora.request import LoRARequest


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lora_name": ""}, "lora_name"),
        ({"lora_int_id": 0}, "lora_int_id"),
        ({"lora_int_id": True}, "lora_int_id"),
        ({"lora_int_id": 1.0}, "lora_int_id"),
        ({"lora_path": ""}, "lora_path"),
    ],
)
def test_bad_fields_are_named(kwargs, field):
    good = {"lora_name": "a", "lora_int_id": 1, "lora_path": "/adapters/a"}
    with pytest.raises(ValueError, match=f"LoRARequest.{field}="):
        LoRARequest(**{**good, **kwargs})


def test_cache_key_separates_adapters():
    a = LoRARequest("a", 1, "/adapters/a")
    assert a.cache_key == ("lora", 1, "a")
    assert a.cache_key == LoRARequest("a", 1, "/elsewhere").cache_key
    assert a.cache_key != LoRARequest("a", 2, "/adapters/a").cache_key
    assert a == LoRARequest(lora_name="a", lora_int_id=1, lora_path="/adapters/a")
