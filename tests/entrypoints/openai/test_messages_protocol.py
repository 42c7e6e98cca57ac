"""The Messages API models on their own: what a request must and may hold (max_tokens,
roles, content blocks, tools), the response the anthropic SDK parses, and Anthropic's
error shape (status -> error type, and OpenAI-shaped bodies rewritten into it)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from xlm.entrypoints.openai.messages_protocol import (
    CountTokensRequest,
    ImageBlockParam,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    TextBlockParam,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    error_body,
    error_type,
    is_messages_path,
    message_id,
    reshape_error,
    tool_use_id,
)

USER = {"role": "user", "content": "hi"}


def _request(**kwargs) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [USER], **kwargs}


def _invalid_fields(body: dict, model=MessagesRequest) -> set[str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return {".".join(str(x) for x in e["loc"]) for e in info.value.errors()}


@pytest.mark.parametrize(
    ("path", "is_messages"),
    [
        ("/v1/messages", True),
        ("/v1/messages/count_tokens", True),
        ("/v1/messages/batches/x", True),
        ("/v1/messagesX", False),
        ("/v1/chat/completions", False),
        ("/messages", False),
    ],
)
def test_messages_paths_are_the_route_and_what_lies_under_it(path, is_messages):
    assert is_messages_path(path) is is_messages


def test_max_tokens_is_required_on_messages_but_not_on_count_tokens():
    assert "max_tokens" in _invalid_fields({"model": "m", "messages": [USER]})
    for value in (-(2**31) - 1, 2**31, "many"):  # the int32 range; the sign is chat's
        assert "max_tokens" in _invalid_fields(_request(max_tokens=value))
    counted = CountTokensRequest.model_validate({"model": "m", "messages": [USER]})
    assert counted.messages[0].content == "hi" and not hasattr(counted, "max_tokens")
    assert "max_tokens" in MessagesRequest.model_json_schema()["required"]
    assert "max_tokens" not in CountTokensRequest.model_json_schema()["required"]


def test_content_blocks_parse_by_their_type():
    content = [
        {"type": "text", "text": "a"},
        {"type": "image", "source": {"type": "base64", "data": "x"}},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Paris"}},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [{"type": "text", "text": "b"}],
        },
        {"type": "thinking", "thinking": "hmm", "signature": "s"},
        {"type": "redacted_thinking", "data": "opaque"},
    ]
    request = MessagesRequest.model_validate(
        _request(messages=[{"role": "user", "content": content}])
    )
    blocks = request.messages[0].content
    assert [type(b) for b in blocks] == [
        TextBlockParam,
        ImageBlockParam,
        ToolUseBlockParam,
        ToolResultBlockParam,
        ThinkingBlockParam,
        ThinkingBlockParam,
    ]
    assert blocks[2].input == {"city": "Paris"} and blocks[3].content[0].text == "b"
    assert blocks[5].type == "redacted_thinking" and blocks[5].data == "opaque"


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "system", "content": "x"}], "messages.0.role"),
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "audio", "data": "x"}]}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content"),
        (
            [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}],
            "messages.0.content",
        ),
    ],
)
def test_bad_turns_and_blocks_are_refused_where_they_are(messages, field):
    fields = _invalid_fields(_request(messages=messages))
    assert any(f.startswith(field) for f in fields), fields


def test_tools_and_tool_choice_shapes():
    tool = {"name": "f", "input_schema": {"type": "object"}}
    request = MessagesRequest.model_validate(
        _request(tools=[tool], tool_choice={"type": "tool", "name": "f"})
    )
    assert request.tools[0].name == "f" and request.tool_choice.name == "f"
    assert "tools.0.name" in _invalid_fields(_request(tools=[{**tool, "name": ""}]))
    assert "tools.0.input_schema" in _invalid_fields(_request(tools=[{"name": "f"}]))
    assert "tool_choice.type" in _invalid_fields(_request(tool_choice={"type": "some"}))


def test_unknown_fields_are_accepted_and_kept_aside():
    request = MessagesRequest.model_validate(
        _request(service_tier="auto", messages=[{**USER, "cache_control": {"type": "ephemeral"}}])
    )
    assert request.model_extra == {"service_tier": "auto"}
    assert request.messages[0].model_extra == {"cache_control": {"type": "ephemeral"}}
    assert request.stream is False and request.system is None


def test_the_response_parses_as_the_sdks_message():
    anthropic_types = pytest.importorskip("anthropic.types")
    response = MessagesResponse(
        model="m",
        content=[{"type": "text", "text": "hello"}],
        stop_reason="end_turn",
        usage=MessagesUsage(input_tokens=5, output_tokens=1),
    )
    parsed = anthropic_types.Message.model_validate(response.model_dump())
    assert parsed.id == response.id and parsed.id.startswith("msg_")
    assert parsed.type == "message" and parsed.role == "assistant"
    assert parsed.content[0].text == "hello" and parsed.usage.output_tokens == 1


def test_ids_have_their_prefix_and_do_not_repeat():
    messages = {message_id() for _ in range(50)}
    tools = {tool_use_id() for _ in range(50)}
    assert len(messages) == len(tools) == 50
    assert all(i.startswith("msg_") and len(i) == 28 for i in messages)
    assert all(i.startswith("toolu_") and len(i) == 30 for i in tools)


# Anthropic's documented error types (docs.anthropic.com/en/api/errors); xlm answers its
# own capacity limit (429) as overloaded, as Anthropic answers its 529.
@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (415, "invalid_request_error"),
        (422, "invalid_request_error"),
        (429, "overloaded_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (529, "api_error"),
    ],
)
def test_status_maps_to_anthropics_error_type(status, expected):
    assert error_type(status) == expected
    assert error_body(status, "why") == {
        "type": "error",
        "error": {"type": expected, "message": "why"},
    }


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (
            400,
            {"error": {"message": "max_tokens too large", "type": "x", "param": "max_tokens"}},
            "max_tokens too large",
        ),
        (405, {"detail": "Method Not Allowed"}, "Method Not Allowed"),
        (422, {"detail": [{"loc": ["body"]}]}, '{"detail": [{"loc": ["body"]}]}'),
        (500, "Internal Server Error", "Internal Server Error"),
    ],
)
def test_other_error_bodies_are_rewritten_keeping_their_message(status, body, message):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    assert json.loads(reshape_error(status, raw)) == error_body(status, message)


def test_anthropic_bodies_pass_and_undecodable_bytes_are_replaced():
    already = json.dumps(error_body(404, "gone")).encode()
    assert reshape_error(404, already) is already
    reshaped = json.loads(reshape_error(502, b"bad \xff gateway"))
    assert reshaped == error_body(502, "bad \ufffd gateway")
