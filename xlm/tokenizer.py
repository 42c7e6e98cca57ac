"""Tokenizers: fast Hugging Face tokenizers from a directory or a GGUF file, and chat templates."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from xlm.logger import init_logger

logger = init_logger(__name__)


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


@lru_cache(maxsize=8)
def _load_tokenizer(source: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    if _is_gguf(source):
        tokenizer = _gguf_tokenizer(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {source!r} loaded as the slow {type(tokenizer).__name__}; "
            "xlm needs a fast (Rust `tokenizers`) tokenizer"
        )
    logger.debug("Loaded tokenizer %s from %s", type(tokenizer).__name__, source)
    return tokenizer


def _gguf_tokenizer(path: str) -> Any:
    """The fast tokenizer a GGUF file describes, saved once under XLM_CACHE_ROOT.

    transformers' own `gguf_file=` path reads the file with a reader that imports torch,
    which xlm does not need; so the metadata comes from xlm's reader and transformers'
    converter builds the tokenizer from it (vocabulary, merges, pre-tokenizer, special
    tokens, chat template). Converting takes seconds; the saved copy loads in a fraction.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from xlm import envs
    from xlm.models.loader.gguf_reader import GGUFFile

    stat = os.stat(path)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cache_dir = os.path.join(envs.XLM_CACHE_ROOT, "gguf_tokenizers", key)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache_dir)
    metadata = GGUFFile(path).metadata
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict.get("tokens")
    if not tokens:
        raise ValueError(f"GGUF file {path} carries no tokenizer vocabulary")
    for name, id_key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{id_key}")
        config[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{**config, **extra})
    try:
        tmp = f"{cache_dir}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cache_dir)
    except OSError as e:  # a read-only cache costs only the conversion next time
        logger.warning("Could not save the converted GGUF tokenizer: %s", e)
    return tokenizer


def get_tokenizer(model: str, tokenizer: str | None = None, trust_remote_code: bool = False) -> Any:
    """A fast tokenizer for `model` (a directory, a .gguf file or a built-in name), cached."""
    from xlm.models.builtin import resolve_model_name

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
