"""A request that could never run is refused before it queues, with the numbers."""

import pytest

from tests.core.sim import make_request
from xlm.core.admission import check_new_request
from xlm.core.kv_cache_manager import KVCacheManager
from xlm.lora.request import LoRARequest


def _check(prompt_len, num_blocks=9, max_len=100, max_loras=None, lora=None):
    request = make_request("r", [1] * prompt_len)
    request.lora_request = lora
    kv = KVCacheManager(num_blocks, 4, max_len)  # 8 usable blocks of 4 = 32 tokens
    check_new_request(request, max_len, kv, max_loras)


def test_a_prompt_the_cache_holds_is_admitted():
    _check(32)


@pytest.mark.parametrize(
    "prompt_len, message",
    [
        (0, "empty prompt"),
        (101, "101 tokens, longer than max_model_len=100"),
        (33, r"33 tokens and needs 9 KV cache blocks of 4 tokens.*only 8 blocks \(32 tokens\)"),
    ],
)
def test_a_prompt_that_never_fits_names_the_numbers(prompt_len, message):
    with pytest.raises(ValueError, match=message):
        _check(prompt_len)


def test_an_adapter_needs_lora_on():
    lora = LoRARequest("sql", 1, "/nowhere")
    with pytest.raises(ValueError, match="'sql' but LoRA is off.*--enable-lora"):
        _check(4, lora=lora)
    _check(4, lora=lora, max_loras=1)
