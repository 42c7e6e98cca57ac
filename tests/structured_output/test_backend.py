"""The llguidance backend: each kind of constraint compiles to a matcher that accepts the
texts Python's own re / json say fit and refuses the rest; a constraint compiles once per
spec (concurrent askers wait for it); invalid ones fail naming the field (the manager and
scheduler on top: tests/structured_output/test_manager.py)."""

from __future__ import annotations

import json
import re
import threading

import pytest

from tests.bpe_tokenizer import train_byte_level_bpe
from xlm.structured_output import backend
from xlm.structured_output.backend import (
    GrammarCompiler,
    _close_objects,
    make_ll_tokenizer,
    validate,
)
from xlm.structured_output.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
}


@pytest.fixture(scope="module")
def tokenizer():
    text = '{"ok": true, "n": 42} alpha beta 2024-01-31'
    return train_byte_level_bpe(text, 300, ["<eos>"], eos_token="<eos>")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(make_ll_tokenizer(tokenizer, len(tokenizer), [0]))


def _accepts(compiler, tokenizer, params, text: str) -> bool:
    """Whether the constraint's matcher takes every token of `text` and may then stop."""
    matcher = compiler.matcher(params)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize(
    "text", ["2024-01-31", "1999-12-01", "2024-1-31", "2024-01-31x", "abcd-ef-gh", ""]
)
def test_a_regex_accepts_what_re_fullmatch_accepts(compiler, tokenizer, text):
    pattern = r"\d{4}-\d{2}-\d{2}"
    want = re.fullmatch(pattern, text) is not None
    assert _accepts(compiler, tokenizer, StructuredOutputsParams(regex=pattern), text) == want


@pytest.mark.parametrize(
    "text, fits",
    [
        ('{"ok": true, "n": 42}', True),
        ('{"ok": false, "n": -7}', True),  # (llguidance keeps the schema's key order)
        ('{"ok": true}', False),  # "n" is required
        ('{"ok": "yes", "n": 1}', False),
        ('{"ok": true, "n": 4.5}', False),
    ],
)
def test_a_json_schema_accepts_the_documents_that_fit_it(compiler, tokenizer, text, fits):
    assert json.loads(text)  # each is valid JSON; the schema decides
    assert _accepts(compiler, tokenizer, StructuredOutputsParams(json=SCHEMA), text) == fits


def test_choice_json_object_and_closed_objects(compiler, tokenizer):
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    assert _accepts(compiler, tokenizer, choice, "beta")
    assert not _accepts(compiler, tokenizer, choice, "alphabet")
    any_object = StructuredOutputsParams(json_object=True)
    assert _accepts(compiler, tokenizer, any_object, '{"x": [1, 2]}')
    assert not _accepts(compiler, tokenizer, any_object, "[1, 2]")
    extra = '{"ok": true, "n": 1, "more": 2}'
    assert _accepts(compiler, tokenizer, StructuredOutputsParams(json=SCHEMA), extra)
    closed = StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True)
    assert not _accepts(compiler, tokenizer, closed, extra)
    lark = StructuredOutputsParams(grammar='start: "a" "b"+')
    assert _accepts(compiler, tokenizer, lark, "abbb") and not _accepts(
        compiler, tokenizer, lark, "ba"
    )


def test_close_objects_closes_every_open_object_and_no_other():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": [{"type": "object"}]},
        },
    }
    closed = _close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True  # said so explicitly
    assert closed["properties"]["list"]["items"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["list"]
    assert "additionalProperties" not in schema  # the caller's schema is not changed


@pytest.mark.parametrize(
    "params, field",
    [
        (StructuredOutputsParams(regex="(unclosed"), "regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
    ],
)
def test_invalid_constraints_fail_naming_the_field(compiler, params, field):
    with pytest.raises(ValueError, match=f"StructuredOutputsParams.{field} is invalid"):
        validate(params)
    with pytest.raises(ValueError, match=f"StructuredOutputsParams.{field} is invalid"):
        compiler.matcher(params)


def test_a_spec_compiles_once_even_when_asked_concurrently(tokenizer, monkeypatch):
    compiler = GrammarCompiler(make_ll_tokenizer(tokenizer, len(tokenizer), [0]))
    params = StructuredOutputsParams(regex="[ab]{3}")
    matchers = []
    threads = [
        threading.Thread(target=lambda: matchers.append(compiler.matcher(params))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(matchers) == 4 and len({id(m) for m in matchers}) == 4  # each its own state
    assert compiler.num_compiled == 1 and compiler.num_cache_hits == 3
    # Past the cache size the least recently used template is dropped and compiles again.
    monkeypatch.setattr(backend, "GRAMMAR_CACHE_SIZE", 1)
    compiler.matcher(StructuredOutputsParams(regex="c+"))
    compiler.matcher(params)
    assert compiler.num_compiled == 3
    compiler.clear()
    compiler.matcher(params)
    assert compiler.num_compiled == 4


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(tokenizer):
    first = make_ll_tokenizer(tokenizer, len(tokenizer), [0])
    assert make_ll_tokenizer(tokenizer, len(tokenizer), [0]) is first
    assert make_ll_tokenizer(tokenizer, len(tokenizer) + 4, [0]) is not first
