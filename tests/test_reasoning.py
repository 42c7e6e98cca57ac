"""xlm.reasoning: the parsers' whole-text split, their streamed split, and the registry."""

import pytest

from xlm.reasoning import REASONING_PARSERS, get_reasoning_parser

TEXTS = [
    "<think>The user wants a number.</think>The answer is 42.",
    "<think>still thinking",
    "Just an answer <b> with </thi and < in it.",
    "thinking</think>done",
    "",
]


def _streamed(name: str, text: str, size: int) -> tuple[str, str]:
    stream = get_reasoning_parser(name).stream()
    reasoning, content = "", ""
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        delta = stream.add(piece, final=i == len(pieces) - 1)
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_split_matches_whole_text_split(name, text, size):
    whole = get_reasoning_parser(name).extract(text)
    assert _streamed(name, text, size) == tuple(x or "" for x in whole)


def test_whole_text_split_per_parser():
    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    # deepseek_r1's template opens <think> in the prompt: all text before </think> reasons.
    assert r1.extract("a</think>b") == ("a", "b")
    assert r1.extract("<think>a</think>b") == ("a", "b")
    assert r1.extract("no tags") == ("no tags", None)
    # qwen3 reasons only inside an explicit leading <think>...</think>.
    assert qwen3.extract("<think>a</think>b") == ("a", "b")
    assert qwen3.extract("a</think>b") == (None, "a</think>b")


def test_reasoning_end_in_prompt():
    parser = get_reasoning_parser("deepseek_r1")
    assert not parser.is_reasoning_end("<|user|>hi<|assistant|><think>\n")
    assert parser.is_reasoning_end("<think>\n\n</think>\n\n")
    assert not parser.is_reasoning_end("no tags")


def test_unknown_parser_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"reasoning_parser='nope' is invalid: allowed \["):
        get_reasoning_parser("nope")
