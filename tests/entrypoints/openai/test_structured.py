"""OpenAI fields -> constraints, tool-call parsers, reasoning parsers and chat output
parsing (whole and streamed): pure functions, no engine."""

from __future__ import annotations

import json

import pytest

from xlm.entrypoints.openai.chat_output import ChatOutputParser
from xlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
)
from xlm.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser
from xlm.reasoning import get_reasoning_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**kwargs):
    return ChatCompletionRequest(messages=MESSAGES, **kwargs).to_sampling_params()


def test_response_format_maps_to_constraints():
    assert chat(response_format={"type": "text"}).structured_outputs is None
    assert chat(response_format={"type": "json_object"}).structured_outputs.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        }
    ).structured_outputs
    assert so.json == schema and so.disable_additional_properties
    with pytest.raises(RequestValidationError) as e:
        chat(response_format={"type": "yaml"})
    assert e.value.param == "response_format"


def test_vllm_fields_map_to_constraints():
    assert chat(guided_regex="[0-9]+").structured_outputs.regex == "[0-9]+"
    assert chat(guided_choice=["a", "b"]).structured_outputs.choice == ["a", "b"]
    assert chat(guided_json='{"type": "object"}').structured_outputs.json == {"type": "object"}
    assert chat(guided_grammar='start: "x"').structured_outputs.grammar == 'start: "x"'
    assert chat(structured_outputs={"choice": ["y"]}).structured_outputs.choice == ["y"]
    completion = CompletionRequest(prompt="x", structured_outputs={"regex": "a"})
    assert completion.to_sampling_params().structured_outputs.regex == "a"
    for bad, param in (
        (dict(guided_regex="a", guided_choice=["a"]), "guided_choice"),
        (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (dict(guided_choice=[]), "guided_choice"),
    ):
        with pytest.raises(RequestValidationError) as e:
            chat(**bad)
        assert e.value.param == param


def test_tool_choice_constraints():
    so = chat(tools=TOOLS, tool_choice="required").structured_outputs
    assert so.json["type"] == "array" and so.json["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in so.json["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert (
        chat(tools=TOOLS, tool_choice=named).structured_outputs.json
        == (TOOLS[0]["function"]["parameters"])
    )
    assert chat(tools=TOOLS, tool_choice="auto").structured_outputs is None
    assert chat(tools=TOOLS, tool_choice="none").structured_outputs is None
    for bad in (
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=[{"type": "function"}], tool_choice="required"),
        dict(tools=TOOLS, tool_choice="required", guided_regex="a"),
    ):
        with pytest.raises(RequestValidationError):
            chat(**bad)


def test_hermes_parser():
    parser = get_tool_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
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
