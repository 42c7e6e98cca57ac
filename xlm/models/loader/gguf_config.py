"""A GGUF model's config, read at warm start without importing transformers.

`gguf.load_gguf_config` builds the transformers config a GGUF's metadata describes; with
PyTorch installed, importing transformers' configuration module imports torch, seconds
before the first token that xlm never uses. So the first load freezes that config into a
`ConfigSnapshot` (every public attribute it answers, its `to_dict()` and its JSON string),
kept in xlm's disk cache beside the converted tokenizer and the dequantized weights, and
later starts read the snapshot. The snapshot answers what the transformers config
answered, so the engine, the models and the compiled programs' keys see the same values.
The entry is written and checked through xlm.disk_cache and keyed by xlm's version, the
converter's source, transformers' version and the file's path, size and mtime.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
from typing import Any

from xlm import disk_cache, envs
from xlm.logger import init_logger

logger = init_logger(__name__)

_TUPLE, _ITEMS = "__xlm_tuple__", "__xlm_items__"
_CONVERTER_SOURCES = (__file__, os.path.join(os.path.dirname(__file__), "gguf.py"))


class ConfigSnapshot:
    """The values of a transformers config as a plain object (no transformers import)."""

    def __init__(
        self, attributes: dict[str, Any], config_dict: dict[str, Any], json_string: str
    ) -> None:
        """`attributes` and `config_dict` as `snapshot` stores them (tagged JSON)."""
        self.__dict__.update(_decode(attributes))
        self._config_dict = _decode(config_dict)
        self._json_string = json_string

    def to_dict(self) -> dict[str, Any]:
        """The transformers config's `to_dict()`."""
        return copy.deepcopy(self._config_dict)

    def to_json_string(self) -> str:
        """The transformers config's `to_json_string()` (its diff against the defaults)."""
        return self._json_string

    def get_text_config(self, *args: Any, **kwargs: Any) -> ConfigSnapshot:
        """A decoder-only config is its own text config."""
        return self

    def __repr__(self) -> str:
        return f"ConfigSnapshot {self._json_string}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigSnapshot) and self.__dict__ == other.__dict__


def _encode(value: Any) -> Any:
    """`value` in JSON's types, with tuples and dicts of non-string keys tagged."""
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TUPLE not in value:
            return {k: _encode(v) for k, v in value.items()}
        return {_ITEMS: [[_encode(k), _encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} is not stored")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if _TUPLE in value:
            return tuple(_decode(v) for v in value[_TUPLE])
        if _ITEMS in value:
            return {_decode(k): _decode(v) for k, v in value[_ITEMS]}
        return {k: _decode(v) for k, v in value.items()}
    return value


def snapshot(config: Any) -> dict[str, Any]:
    """The JSON-storable form of a transformers config: its public non-callable attributes
    (aliases and properties included), `to_dict()` and `to_json_string()`."""
    from transformers.utils import logging as hf_logging

    attributes = {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # reading deprecated aliases (torch_dtype) warns
    try:
        # dir() does not list the aliases (GPT-2's hidden_size for n_embd).
        for name in sorted({*dir(config), *getattr(config, "attribute_map", {})}):
            if name.startswith("_"):
                continue
            try:
                value = getattr(config, name)
                if not callable(value):
                    attributes[name] = _encode(value)
            except Exception:  # a property that does not apply, a value JSON cannot hold
                continue
    finally:
        hf_logging.set_verbosity(verbosity)
    return {
        "attributes": attributes,
        "config_dict": _encode(config.to_dict()),
        "json_string": config.to_json_string(),
    }


def _entry_path(path: str) -> str:
    stat = os.stat(path)
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = None
    key = disk_cache.cache_key(
        path,
        stat.st_size,
        stat.st_mtime_ns,
        disk_cache.source_fingerprint(*_CONVERTER_SOURCES),
        transformers_version,
    )
    return os.path.join(envs.XLM_CACHE_ROOT, "gguf_configs", key + ".json")


def cached_gguf_config(path: str) -> ConfigSnapshot:
    """The config of the GGUF file at `path`: from the cache, or built and cached."""
    from xlm.models.loader.gguf import load_gguf_config

    path = os.path.abspath(path)
    entry = _entry_path(path)
    payload = disk_cache.read_entry(entry)
    if payload is not None:
        try:
            return ConfigSnapshot(**json.loads(payload))
        except (ValueError, TypeError):
            logger.warning("Discarding the unreadable cached GGUF config %s.", entry)
            disk_cache.discard(entry)
    frozen = snapshot(load_gguf_config(path))
    try:
        disk_cache.make_private_dir(os.path.dirname(entry))
        disk_cache.write_entry(entry, json.dumps(frozen).encode())
    except OSError as e:  # a read-only cache costs only the transformers import next time
        logger.warning("Could not save the GGUF config: %s", e)
    return ConfigSnapshot(**frozen)
