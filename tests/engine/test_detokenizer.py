"""Incremental detokenization and stop strings, against the tokenizer's own whole-sequence
decode (a byte-level BPE that splits non-ASCII characters into byte tokens); the same
through OutputProcessor: tests/engine/test_output_processor.py."""

from __future__ import annotations

import pytest

from tests.bpe_tokenizer import hello_tokenizer
from xlm.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, check_stop_strings
from xlm.sampling_params import SamplingParams

TEXT = "Hello 😀 world, 你好 naïve café! The stop word is here."


@pytest.fixture(scope="module")
def tokenizer():
    return hello_tokenizer()


def _stream(tokenizer, params, ids, prompt=(5, 6), per_step=1):
    """Feed `ids` a few at a time; the detokenizer, each step's delta and the stop match."""
    detok = IncrementalDetokenizer(TokenizerInfo(tokenizer), list(prompt), params)
    deltas, stop = [], None
    for i in range(0, len(ids), per_step):
        finished = i + per_step >= len(ids)
        stop = detok.update(ids[i : i + per_step], stop_terminated=False, finished=finished)
        deltas.append(detok.get_next_output_text(finished or stop is not None, delta=True))
        if stop is not None:
            break
    return detok, deltas, stop


@pytest.mark.parametrize("per_step", [1, 3])
def test_streamed_text_equals_the_whole_decode_and_never_splits_a_character(tokenizer, per_step):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # many multi-byte characters span several tokens
    detok, deltas, stop = _stream(tokenizer, SamplingParams(), ids, per_step=per_step)
    assert stop is None and "".join(deltas) == detok.output_text == TEXT
    assert detok.output_text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.num_output_tokens == len(ids)


def test_whole_sequence_decode_and_single_tokens(tokenizer):
    info = TokenizerInfo(tokenizer)
    ids = [tokenizer.bos_token_id, *tokenizer.encode("Hello world", add_special_tokens=False)]
    ids.append(tokenizer.eos_token_id)
    skip = SamplingParams(skip_special_tokens=True)
    assert info.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=True)
    assert info.decode(ids, skip) == "Hello world"
    keep = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert info.decode(ids, keep) == tokenizer.decode(ids) == "<s>Hello world</s>"
    spaced = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    assert info.decode(ids, spaced) == "<s> Hello world </s>"
    assert info.special_ids == {tokenizer.bos_token_id, tokenizer.eos_token_id}
    for token_id in ids:
        assert info.decode_token(token_id) == tokenizer.decode([token_id])


def test_check_stop_strings_finds_the_earliest_in_or_into_the_new_text():
    # "stop" straddles the old text and the 3 new characters: found, cut before it.
    assert check_stop_strings("abc stop!", 3, ["stop"], False) == ("stop", 4)
    assert check_stop_strings("abc stop!", 3, ["stop"], True) == ("stop", 8)
    # Only in the old text (already checked last step): not matched again.
    assert check_stop_strings("stop abcdef", 3, ["stop"], False) is None
    # Two candidates: the earlier one wins, whatever the list order.
    assert check_stop_strings("xx a b", 5, ["b", "a"], False) == ("a", 3)
    assert check_stop_strings("hello", 5, ["z"], False) is None


def test_a_stop_string_trims_the_text_and_is_never_sent_in_part(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=["stop word"])
    detok, deltas, stop = _stream(tokenizer, params, ids)
    assert stop == "stop word" and detok.output_text == TEXT[: TEXT.index("stop word")]
    assert "".join(deltas) == detok.output_text
    assert detok.stop_buffer_length == len("stop word") - 1
    kept = SamplingParams(stop=["stop word"], include_stop_str_in_output=True)
    detok, deltas, _ = _stream(tokenizer, kept, ids)
    assert detok.output_text == TEXT[: TEXT.index("stop word") + len("stop word")]
    assert detok.stop_buffer_length == 0


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, Hello world", add_special_tokens=False)
    first = len(tokenizer.encode("Hello", add_special_tokens=False))
    params = SamplingParams(stop=["Hello"], min_tokens=first + 1)
    detok, _, stop = _stream(tokenizer, params, ids)
    assert stop == "Hello" and detok.output_text == "Hello world, "


def test_the_stop_tokens_text_and_no_detokenize(tokenizer):
    ids = [*tokenizer.encode("Hello", add_special_tokens=False), tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(TokenizerInfo(tokenizer), [5], params)
    detok.update(ids, stop_terminated=True, finished=True)
    assert detok.output_text == "Hello"  # the EOS is not part of the text
    off = IncrementalDetokenizer(TokenizerInfo(tokenizer), [1], SamplingParams(detokenize=False))
    assert off.update(ids, stop_terminated=False, finished=True) is None
    assert off.output_text == "" and off.num_output_tokens == len(ids)


def test_full_outputs_hold_back_a_possible_stop_prefix_until_finished(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(TokenizerInfo(tokenizer), [1], SamplingParams(stop=["xyz"]))
    detok.update(ids, stop_terminated=False, finished=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello wor"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world"
