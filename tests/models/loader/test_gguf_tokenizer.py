"""The tokenizer xlm builds from a GGUF's metadata equals transformers' own GGUF tokenizer
(its gguf_file= path) on the real SmolLM2 file, and is converted once into the disk cache."""

from __future__ import annotations

import os

import pytest
from gguf import GGUFWriter

from tests.test_tokenizer import TEXTS
from xlm.models.loader.gguf_tokenizer import convert_gguf_tokenizer, gguf_tokenizer


@pytest.fixture(scope="module")
def converted(smollm2_gguf):
    return convert_gguf_tokenizer(smollm2_gguf)


def test_gguf_tokenizer_matches_transformers(converted, smollm2_transformers_tokenizer):
    reference = smollm2_transformers_tokenizer
    assert converted.is_fast
    assert len(converted) == len(reference) == 49152
    assert converted.get_vocab() == reference.get_vocab()
    for text in TEXTS:
        ids = converted.encode(text)
        assert ids == reference.encode(text)
        assert converted.decode(ids) == reference.decode(ids) == text
    assert converted.encode("<|im_end|>") == [2]
    assert (converted.bos_token, converted.eos_token, converted.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert converted.chat_template == reference.chat_template
    assert "<|im_start|>" in converted.chat_template


def test_the_conversion_is_cached_per_file(smollm2_gguf, converted, tmp_path, monkeypatch):
    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path))
    first = gguf_tokenizer(smollm2_gguf)
    (entry,) = os.listdir(tmp_path / "gguf_tokenizers")
    assert os.path.isfile(tmp_path / "gguf_tokenizers" / entry / "tokenizer.json")
    second = gguf_tokenizer(smollm2_gguf)  # read back from the cache
    assert second is not first and os.listdir(tmp_path / "gguf_tokenizers") == [entry]
    for text in TEXTS:
        assert second.encode(text) == first.encode(text) == converted.encode(text)
    assert second.chat_template == converted.chat_template
    assert second.eos_token == "<|im_end|>"


def test_a_gguf_without_a_vocabulary_is_refused(tmp_path):
    path = str(tmp_path / "no_vocab.gguf")
    writer = GGUFWriter(path, "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="carries no tokenizer vocabulary"):
        convert_gguf_tokenizer(path)
