"""The cached snapshot of a GGUF's config answers as the transformers config it froze
(attributes, aliases, to_dict, the JSON string the program keys hash), from the cache too."""

from __future__ import annotations

import os

import pytest

from tests.models.test_gguf_families import gguf_case  # noqa: F401 (fixture)
from xlm.models.loader.gguf import load_gguf_config
from xlm.models.loader.gguf_config import ConfigSnapshot, _encode, _entry_path, cached_gguf_config


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path))
    return tmp_path


def _check_same(snapshot: ConfigSnapshot, ref) -> None:
    assert snapshot.to_json_string() == ref.to_json_string()
    assert snapshot.to_dict() == ref.to_dict()
    for name in {*dir(ref), *ref.attribute_map}:
        if name.startswith("_") or callable(getattr(ref, name, None)):
            continue
        try:
            want = getattr(ref, name)
        except Exception:
            assert not hasattr(snapshot, name), name
            continue
        if hasattr(snapshot, name):
            assert getattr(snapshot, name) == want, name
        else:  # left out only when JSON cannot hold it
            with pytest.raises(TypeError):
                _encode(want)


def _path(case: str, smollm2_gguf: str, gguf_case) -> str:  # noqa: F811
    return smollm2_gguf if case == "smollm2" else gguf_case(case)[1]


@pytest.mark.parametrize("case", ["smollm2", "gpt2", "gemma2"])
def test_snapshot_answers_as_the_transformers_config(
    case,
    smollm2_gguf,
    gguf_case,  # noqa: F811
    cache_root,
):
    path = _path(case, smollm2_gguf, gguf_case)
    ref = load_gguf_config(path)
    built = cached_gguf_config(path)
    assert os.path.isfile(_entry_path(path))
    from_cache = cached_gguf_config(path)
    assert from_cache == built
    _check_same(from_cache, ref)
    # The attributes the engine and the models read, aliases included (GPT-2's n_embd).
    for name in ("hidden_size", "num_hidden_layers", "vocab_size", "architectures"):
        assert getattr(from_cache, name) == getattr(ref, name)
    assert from_cache.id2label == ref.id2label  # a dict of int keys survives JSON


def test_corrupt_entry_is_rebuilt(smollm2_gguf, cache_root):
    cached_gguf_config(smollm2_gguf)
    entry = _entry_path(smollm2_gguf)
    with open(entry, "r+b") as f:
        f.truncate(os.path.getsize(entry) // 2)
    config = cached_gguf_config(smollm2_gguf)
    assert config.to_json_string() == load_gguf_config(smollm2_gguf).to_json_string()
    assert config == cached_gguf_config(smollm2_gguf)  # and written again
