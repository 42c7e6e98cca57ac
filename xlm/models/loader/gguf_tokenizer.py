"""The fast tokenizer a GGUF file describes, converted once and kept in xlm's disk cache.

transformers' own `gguf_file=` path reads the file with a reader that imports torch, which
xlm does not need; so the metadata comes from xlm's GGUF reader and transformers' converter
builds the tokenizer from it (vocabulary, merges, pre-tokenizer, special tokens, chat
template). Converting takes seconds; the cached copy loads in a fraction. The entry is
written and checked through xlm.disk_cache (atomic, 0700, a manifest of sizes) and keyed
by xlm's version, this converter's source and the file's path, size and mtime.
"""

from __future__ import annotations

import os
from typing import Any

from xlm import disk_cache, envs
from xlm.logger import init_logger
from xlm.models.loader.gguf_reader import GGUFFile

logger = init_logger(__name__)

_SPECIAL_TOKENS = (
    ("bos_token", "bos_token_id"),
    ("eos_token", "eos_token_id"),
    ("unk_token", "unknown_token_id"),
    ("pad_token", "padding_token_id"),
)


def gguf_tokenizer(path: str) -> Any:
    """The tokenizer of the GGUF file at `path`, from the cache or converted and cached."""
    # transformers is imported here, not at module level: it takes seconds to import and
    # only GGUF models need this converter. The cached copy was saved from a
    # PreTrainedTokenizerFast, which loads it back as AutoTokenizer would, without
    # transformers' configuration module (which imports torch when it is installed).
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(path)
    stat = os.stat(path)
    converter = disk_cache.source_fingerprint(__file__)
    key = disk_cache.cache_key(path, stat.st_size, stat.st_mtime_ns, converter)
    cache_dir = os.path.join(envs.XLM_CACHE_ROOT, "gguf_tokenizers", key)
    if disk_cache.check_directory(cache_dir):
        return PreTrainedTokenizerFast.from_pretrained(cache_dir)
    tokenizer = convert_gguf_tokenizer(path)
    try:
        with disk_cache.atomic_directory(cache_dir) as tmp:
            tokenizer.save_pretrained(tmp)
    except OSError as e:  # a read-only cache costs only the conversion next time
        logger.warning("Could not save the converted GGUF tokenizer: %s", e)
    return tokenizer


def convert_gguf_tokenizer(path: str) -> Any:
    """Build the fast tokenizer from the GGUF metadata (no cache)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
    )
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer as convert_backend,
    )

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
    for name, id_key in _SPECIAL_TOKENS:
        token_id = metadata.get(f"tokenizer.ggml.{id_key}")
        config[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_backend(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**config, **extra})
