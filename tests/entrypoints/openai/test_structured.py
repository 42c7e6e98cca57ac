"""OpenAI fields -> constraints: response_format, vLLM's guided fields and tool_choice map
to structured-output constraints, conflicting ones are refused (pure functions, no
engine; the parsing of the replies: test_chat_output.py and test_tool_parsers.py)."""

from __future__ import annotations

import pytest

from xlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
)

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
