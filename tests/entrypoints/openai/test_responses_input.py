"""Responses requests -> chat requests: input items, instructions, tools, tool_choice,
text.format; every malformed shape a 400 naming its field."""

from __future__ import annotations

import pytest

from xlm.entrypoints.openai.responses_input import (
    normalize_input,
    output_items,
    to_chat_request,
    to_messages,
)
from xlm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
)
from xlm.entrypoints.openai.serving_engine import OpenAIError
from xlm.entrypoints.openai.structured import constraint_of_chat_request

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _chat(**body):
    request = ResponsesRequest.model_validate(body)
    return to_chat_request(request, normalize_input(request.input_), "resp_1")


def test_string_input_and_instructions_are_a_system_then_user_message():
    chat = _chat(input="Hi there", instructions="Be brief.", max_output_tokens=7, temperature=0)
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0
    assert chat.request_id == "resp_1" and not chat.stream


def test_a_tool_conversation_becomes_tool_calls_and_tool_messages():
    items = normalize_input(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Paris?"},
                ],
            },  # noqa: E501
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look."}],
            },  # noqa: E501
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },  # noqa: E501
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
            {"type": "message", "role": "developer", "content": "Answer in French."},
        ]
    )
    assert to_messages(items, None) == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        {"role": "developer", "content": "Answer in French."},
    ]


def test_output_items_round_trip_into_the_next_turn():
    output = [
        ReasoningItem(content=[ReasoningText(text="thinking")]),
        OutputMessage(content=[OutputText(text="Sure.")]),
        FunctionCallItem(call_id="call_9", name="get_weather", arguments="{}"),
    ]
    assert to_messages(output_items(output), None) == [
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        }
    ]


def test_flat_tools_and_named_tool_choice_become_chats_constraint():
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    chat = _chat(input="x", tools=[tool], tool_choice={"type": "function", "name": "get_weather"})
    assert chat.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
        }
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert constraint_of_chat_request(chat).json == WEATHER
    assert _chat(input="x", tools=[tool], tool_choice="required").tool_choice == "required"


def test_text_format_becomes_response_format():
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    chat = _chat(input="x", text={"format": fmt})
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
    }
    constraint = constraint_of_chat_request(chat)
    assert constraint.json == WEATHER and constraint.disable_additional_properties
    assert _chat(input="x", text={"format": {"type": "json_object"}}).response_format == {
        "type": "json_object"
    }
    assert _chat(input="x", text={"format": {"type": "text"}}).response_format is None


def test_streaming_asks_chat_for_usage():
    chat = _chat(input="x", stream=True)
    assert chat.stream and chat.stream_options.include_usage


def test_input_image_parts_become_chats_image_url_parts_in_order():
    url = "data:image/png;base64,iVBORw0KGgo="
    content = [
        {"type": "input_text", "text": "Compare "},
        {"type": "input_image", "image_url": url, "detail": "auto"},
        {"type": "input_image", "image_url": "https://example.com/b.png"},
    ]
    chat = _chat(input=[{"role": "user", "content": content}])
    assert chat.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
            ],
        }
    ]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": [{"type": "image_generation_call"}]}, "input", "not supported"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input",
            "image_url must be a string",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input",
            "text parts",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"input": [3]}, "input", "object"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "yaml"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text", "schema"),
        ({"input": []}, "input", "at least one"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(body, param, words):
    with pytest.raises(OpenAIError) as info:
        _chat(**body)
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_max_output_tokens_must_be_positive():
    from pydantic import ValidationError

    for value in (0, -3, 2**31):
        with pytest.raises(ValidationError):
            ResponsesRequest.model_validate({"input": "x", "max_output_tokens": value})
