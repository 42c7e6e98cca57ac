"""Tool-call parsers for tool_choice="auto": the calls and the content around them in a whole
reply, malformed calls left as content, and the streamed split equal to the whole one
however the text arrives."""

from __future__ import annotations

import json

import pytest

from xlm.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser

HERMES_REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_parser():
    parser = get_tool_parser("hermes")
    text = HERMES_REPLY
    content, calls = parser.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert parser.extract("no calls here") == ("no calls here", [])
    assert parser.extract("<tool_call>{broken</tool_call>")[1] == []


def test_llama3_json_parser():
    parser = get_tool_parser("llama3_json")
    content, calls = parser.extract(
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
        '"parameters": {}}'
    )
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parser.extract("Hello {there}") == ("Hello {there}", [])


def test_argument_spellings_and_unclosed_blocks():
    hermes = get_tool_parser("hermes")
    # Arguments given as JSON text pass through; no arguments at all are "{}".
    _, calls = hermes.extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert (calls[0].name, calls[0].arguments) == ("f", '{"a": 1}')
    _, calls = hermes.extract('<tool_call>{"name": "g"}</tool_call>')
    assert (calls[0].name, calls[0].arguments) == ("g", "{}")
    # A block the reply ended inside still counts when its JSON is whole.
    content, calls = hermes.extract('Hi <tool_call>{"name": "h", "parameters": {"x": "é"}}')
    assert content == "Hi" and calls[0].arguments == '{"x": "é"}'
    # A call without a name leaves the whole reply as content.
    assert hermes.extract('<tool_call>{"arguments": {}}</tool_call>')[1] == []
    llama = get_tool_parser("llama3_json")
    content, calls = llama.extract('<|python_tag|>{"name": "f", "arguments": {"q": 1}}')
    assert content is None and json.loads(calls[0].arguments) == {"q": 1}
    assert llama.extract('{"name": "f"} trailing')[1] == []


def test_start_markers_hold_back_a_marker_still_arriving():
    hermes = get_tool_parser("hermes")
    assert hermes.start_marker("abc <tool_call>{") == 4
    assert hermes.start_marker("abc <tool_") == 4  # may be the start of a marker
    assert hermes.start_marker("abc <b") == -1
    llama = get_tool_parser("llama3_json")
    assert llama.start_marker("  ") == 0 and llama.start_marker(' {"name"') == 0
    assert llama.start_marker("<|python") == 0 and llama.start_marker("Hello") == -1


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(
        ValueError, match=r"tool_call_parser='nope' is invalid: allowed \['hermes', 'llama3_json'\]"
    ):
        get_tool_parser("nope")


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", HERMES_REPLY),
        ("hermes", "no calls, only <b>text</b> <tool"),
        ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "f", "parameters": {}}'),
        ("llama3_json", "Hello {there}"),
    ],
)
def test_streaming_gives_the_whole_parse_however_the_text_arrives(name, text, size):
    whole_content, whole_calls = get_tool_parser(name).extract(text)
    stream = StreamingToolCalls(get_tool_parser(name))
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    content, calls = "", []
    for i, piece in enumerate(pieces):
        new, found = stream.add(piece, final=i == len(pieces) - 1)
        content += new or ""
        calls += found
    assert calls == whole_calls
    assert content.strip() == (whole_content or "").strip()
    if whole_calls:  # nothing of a call leaked out as content
        assert "<tool_call>" not in content and '"name"' not in content
