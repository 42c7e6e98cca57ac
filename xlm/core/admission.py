"""Whether a new request could ever run: the checks a request passes before it queues.

A request refused here would otherwise wait for room that never comes (a prompt longer
than max_model_len or than the whole KV cache) or fail in the runner (an adapter with
LoRA off), so the scheduler refuses it at add_request with a ValueError that names the
numbers.
"""

from __future__ import annotations

from typing import Any

from xlm.core.request import Request


def check_new_request(
    request: Request, max_model_len: int, kv_cache_manager: Any, max_loras: int | None
) -> None:
    """Raise ValueError when `request` could never be scheduled: an empty prompt, an
    adapter with LoRA off (`max_loras` None), a prompt past max_model_len or the cache."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise ValueError(f"request {request.request_id!r} has an empty prompt")
    if request.lora_request is not None and max_loras is None:
        raise ValueError(
            f"request {request.request_id!r} names LoRA adapter "
            f"{request.lora_request.lora_name!r} but LoRA is off: start the engine with "
            "enable_lora=True (--enable-lora)"
        )
    if num_prompt > max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: the prompt has {num_prompt} tokens, longer "
            f"than max_model_len={max_model_len}"
        )
    if not kv_cache_manager.can_fit(num_prompt):
        need = kv_cache_manager.num_blocks_to_fit(num_prompt)
        have = kv_cache_manager.num_usable_blocks
        block_size = kv_cache_manager.block_size
        raise ValueError(
            f"request {request.request_id!r}: the prompt has {num_prompt} tokens and needs "
            f"{need} KV cache blocks of {block_size} tokens, but the cache has only "
            f"{have} blocks ({have * block_size} tokens)"
        )
