"""Tokenizers: fast Hugging Face tokenizers from a directory or a GGUF file, and chat templates."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from xlm.logger import init_logger
from xlm.models.builtin import resolve_model_name

logger = init_logger(__name__)


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


@lru_cache(maxsize=8)
def _load_tokenizer(source: str, trust_remote_code: bool) -> Any:
    if _is_gguf(source):
        # The GGUF reader lives in the models loader, which imports jax: only GGUF
        # tokenizers pay for that, so the import stays here.
        from xlm.models.loader.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(source)
    else:
        from transformers import AutoTokenizer  # imports torch where it is installed

        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {source!r} loaded as the slow {type(tokenizer).__name__}; "
            "xlm needs a fast (Rust `tokenizers`) tokenizer"
        )
    logger.debug("Loaded tokenizer %s from %s", type(tokenizer).__name__, source)
    return tokenizer


def get_tokenizer(model: str, tokenizer: str | None = None, trust_remote_code: bool = False) -> Any:
    """A fast tokenizer for `model` (a directory, a .gguf file or a built-in name), cached."""
    source = resolve_model_name(tokenizer if tokenizer is not None else model)
    return _load_tokenizer(os.path.abspath(os.path.expanduser(source)), trust_remote_code)


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render `messages` with the tokenizer's (or the given) chat template into token ids.

    `template_kwargs` become extra variables of the template (a chat request's
    `chat_template_kwargs`, e.g. `enable_thinking`); they cannot replace the arguments above.
    """
    extra = dict(template_kwargs or {})
    reserved = sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved}: use the request's own fields"
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "add_generation_prompt=True and continue_final_message=True cannot be used together: "
            "the first starts a new assistant turn, the second extends the last message"
        )
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template: the tokenizer has no chat template; pass chat_template= "
            "(a Jinja template string) to format chat messages"
        )
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError(
            "continue_final_message=True needs the last message to be the assistant's, "
            f"got role {messages[-1].get('role') if messages else None!r}"
        )
    ids = tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        tokenize=True,
        return_dict=False,
        **extra,
    )
    if isinstance(ids, Mapping):  # transformers versions that ignore return_dict=False
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _as_ids(value: Any) -> Iterable[int]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return (int(v) for v in value)


def get_eos_token_ids(
    tokenizer: Any, hf_config: Any = None, generation_config: Any = None
) -> set[int]:
    """Every end-of-sequence token id named by the tokenizer, model config or generation config."""
    ids: set[int] = set()
    ids.update(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    for config in (hf_config, generation_config):
        if config is None:
            continue
        if isinstance(config, Mapping):
            ids.update(_as_ids(config.get("eos_token_id")))
        else:
            ids.update(_as_ids(getattr(config, "eos_token_id", None)))
    return ids
