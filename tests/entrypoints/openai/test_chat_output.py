"""One chat choice's text -> reasoning_content, content and tool_calls, whole and streamed,
for each tool_choice mode (the tool-call parsers themselves: test_tool_parsers.py)."""

from __future__ import annotations

import json

import pytest

from xlm.entrypoints.openai.chat_output import ChatOutputParser
from xlm.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser
from xlm.reasoning import get_reasoning_parser


def _stream(parser, pieces):
    """Feed pieces; return the concatenated (reasoning, content, tool-call deltas)."""
    reasoning, content, deltas = "", "", []
    for i, piece in enumerate(pieces):
        r, c, d = parser.add(piece, final=i == len(pieces) - 1)
        reasoning += r or ""
        content += c or ""
        deltas.extend(d)
    return reasoning, content, deltas


def split_chars(text, size=3):
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_split_whole_and_streamed(name):
    parser = get_reasoning_parser(name)
    text = "<think>The user wants a number.</think>The answer is 42."
    assert parser.extract(text) == ("The user wants a number.", "The answer is 42.")
    chat_parser = ChatOutputParser(parser, "none")
    assert _stream(chat_parser, split_chars(text))[:2] == (
        "The user wants a number.",
        "The answer is 42.",
    )
    # No tags: qwen3 has only content; deepseek_r1 (tag opened in the prompt) only reasoning
    # until </think>.
    plain = "Just an answer <b>."
    expected = (None, plain) if name == "qwen3" else (plain, None)
    assert parser.extract(plain) == expected
    streamed = _stream(ChatOutputParser(parser, "none"), split_chars(plain, 2))[:2]
    assert streamed == tuple(x or "" for x in expected)
    assert get_reasoning_parser(name).extract("thinking</think>done") == (
        ("thinking", "done") if name == "deepseek_r1" else (None, "thinking</think>done")
    )


def test_streamed_tool_calls_match_whole_parse():
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    parser = ChatOutputParser(None, "auto", get_tool_parser("hermes"))
    _, content, deltas = _stream(parser, split_chars(text, 4))
    assert content == "Sure." and parser.has_tool_calls
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("get_time", {"tz": "UTC"})
    ]
    whole = ChatOutputParser(None, "auto", get_tool_parser("hermes")).parse(text)
    assert whole[1] == "Sure." and whole[2][0].function.name == "get_time"
    # Plain text streams through as content.
    stream = StreamingToolCalls(get_tool_parser("hermes"))
    assert stream.add("a <b", False) == ("a <b", [])


def test_named_and_required_outputs():
    named = ChatOutputParser(None, "named", function_name="get_weather")
    _, content, deltas = _stream(named, ['{"city"', ': "Rome"}'])
    assert content == "" and deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == '{"city": "Rome"}'
    required = ChatOutputParser(None, "required")
    reply = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
    reply += '{"city": "Lima"}}]'
    _, content, deltas = _stream(required, split_chars(reply, 7))
    assert content == "" and [d.index for d in deltas] == [0, 1]
    assert json.loads(deltas[1].function.arguments) == {"city": "Lima"}
    _, whole_content, calls = ChatOutputParser(None, "required").parse(reply)
    assert whole_content is None and [c.function.name for c in calls] == ["get_time", "get_weather"]


def test_reasoning_then_an_auto_tool_call_whole_and_streamed():
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    text = f"<think>Need the time.</think>Ok.{call}"
    whole = ChatOutputParser(get_reasoning_parser("qwen3"), "auto", get_tool_parser("hermes"))
    reasoning, content, calls = whole.parse(text)
    assert (reasoning, content) == ("Need the time.", "Ok.") and whole.has_tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", "{}")]
    streamed = ChatOutputParser(get_reasoning_parser("qwen3"), "auto", get_tool_parser("hermes"))
    reasoning, content, deltas = _stream(streamed, split_chars(text, 5))
    assert (reasoning, content) == ("Need the time.", "Ok.")
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_time", "{}")]


def test_replies_that_are_not_calls_stay_content():
    required = ChatOutputParser(None, "required")
    assert required.parse("not json") == (None, "not json", []) and not required.has_tool_calls
    assert _stream(ChatOutputParser(None, "required"), ["[1, ", "2]"])[1:] == ("[1, 2]", [])
    none = ChatOutputParser(None, "none", get_tool_parser("hermes"))  # the parser is off
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert none.parse(text) == (None, text, []) and none.tool_parser is None
    named = ChatOutputParser(None, "named", function_name="f")
    assert named.parse("") == (None, None, []) and not named.has_tool_calls
