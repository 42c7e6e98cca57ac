"""Tokenizers from GGUF files and directories, chat templates and EOS ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xlm.models.builtin import resolve_model_name
from xlm.tokenizer import apply_chat_template, get_eos_token_ids, get_tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\nnewlines",
    "unicode: héllo, 日本語, emoji 🤗",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model_name("smollm2-135m")


@pytest.fixture(scope="module")
def reference(smollm2_transformers_tokenizer):
    return smollm2_transformers_tokenizer


def test_chat_template_matches_transformers(gguf_path, reference):
    tokenizer = get_tokenizer(gguf_path)
    ids = apply_chat_template(tokenizer, MESSAGES)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ids == reference.encode(expected, add_special_tokens=False)
    assert tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    without = apply_chat_template(tokenizer, MESSAGES, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(ids) > len(without)


def test_continue_final_message(gguf_path):
    tokenizer = get_tokenizer(gguf_path)
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    ids = apply_chat_template(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe answer is")


def test_explicit_chat_template(gguf_path):
    tokenizer = get_tokenizer(gguf_path)
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    ids = apply_chat_template(tokenizer, MESSAGES, chat_template=template)
    assert tokenizer.decode(ids) == "[system]You are terse.[user]What is 2+2?"


def test_tokenizer_is_cached(gguf_path):
    assert get_tokenizer(gguf_path) is get_tokenizer("smollm2-135m")
    assert get_tokenizer("anything-ignored", tokenizer=gguf_path) is get_tokenizer(gguf_path)


def test_tokenizer_from_directory(gguf_path, tmp_path):
    get_tokenizer(gguf_path).save_pretrained(tmp_path)
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer is not get_tokenizer(gguf_path)
    for text in TEXTS:
        assert tokenizer.encode(text) == get_tokenizer(gguf_path).encode(text)
    assert apply_chat_template(tokenizer, MESSAGES) == apply_chat_template(
        get_tokenizer(gguf_path), MESSAGES
    )


def test_chat_template_errors(gguf_path):
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="chat_template"):
        apply_chat_template(no_template, MESSAGES)
    tokenizer = get_tokenizer(gguf_path)
    with pytest.raises(ValueError, match="add_generation_prompt.*continue_final_message"):
        apply_chat_template(tokenizer, MESSAGES, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message"):
        apply_chat_template(
            tokenizer, MESSAGES, add_generation_prompt=False, continue_final_message=True
        )


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing-dir"):
        get_tokenizer(str(tmp_path / "missing-dir"))


def test_eos_token_ids_merge_all_sources():
    tokenizer = SimpleNamespace(eos_token_id=2)
    hf_config = SimpleNamespace(eos_token_id=[2, 5])
    assert get_eos_token_ids(tokenizer, hf_config, {"eos_token_id": 7}) == {2, 5, 7}
    assert get_eos_token_ids(SimpleNamespace(eos_token_id=None), None, None) == set()
    generation = SimpleNamespace(eos_token_id=None)
    assert get_eos_token_ids(tokenizer, SimpleNamespace(), generation) == {2}
