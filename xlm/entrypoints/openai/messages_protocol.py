"""Pydantic models of Anthropic's Messages API (POST /v1/messages) and its error shape.

The request models check Anthropic's shape only (roles, content blocks, required fields);
everything about sampling and the prompt is checked once, by the chat path the request is
translated to (`serving_messages`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from xlm.entrypoints.openai.limits import Int32
from xlm.entrypoints.openai.protocol import random_uuid

MESSAGES_PATH = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """Whether a path is one of the Messages API's (Anthropic's errors and x-api-key)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicBaseModel(BaseModel):
    """Base of the Messages models: unknown fields are accepted and ignored, like Anthropic's
    newer fields (cache_control, citations, service_tier) that xlm has no use for."""

    model_config = ConfigDict(extra="allow")


# ---- request content blocks ------------------------------------------------------------------


class TextBlockParam(AnthropicBaseModel):
    """{"type": "text", "text": ...}."""

    type: Literal["text"]
    text: str


class ImageBlockParam(AnthropicBaseModel):
    """An image block (source: base64 with media_type and data, or url); the chat path
    loads it under the media policy and refuses it (400) to a text-only model."""

    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlockParam(AnthropicBaseModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(AnthropicBaseModel):
    """The result of a tool call, sent back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam | ImageBlockParam] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(AnthropicBaseModel):
    """Reasoning the assistant produced earlier (dropped from the prompt, as chat templates
    drop earlier turns' reasoning)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlockParam = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(AnthropicBaseModel):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(AnthropicBaseModel):
    """A client tool: its name, description and JSON schema of its input."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(AnthropicBaseModel):
    """{"type": "auto" | "any" | "tool" | "none", "name": ... (for "tool")}."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesConversation(AnthropicBaseModel):
    """What a Messages request and a count_tokens request share: the conversation."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None


class MessagesRequest(MessagesConversation):
    """POST /v1/messages."""

    max_tokens: Int32
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = False


class CountTokensRequest(MessagesConversation):
    """POST /v1/messages/count_tokens."""


class CountTokensResponse(AnthropicBaseModel):
    """The prompt's token count."""

    input_tokens: int


# ---- response ---------------------------------------------------------------------------------


class MessagesUsage(AnthropicBaseModel):
    """Token counts: input_tokens counts the whole prompt (prefix-cache hits included)."""

    input_tokens: int
    output_tokens: int


def message_id() -> str:
    """A random message id."""
    return f"msg_{random_uuid()[:24]}"


def tool_use_id() -> str:
    """A random tool_use block id."""
    return f"toolu_{random_uuid()[:24]}"


class MessagesResponse(AnthropicBaseModel):
    """Response of POST /v1/messages."""

    id: str = Field(default_factory=message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessagesUsage


# ---- errors -----------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "overloaded_error",  # xlm's 429 is the server's capacity, not a client's quota
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def reshape_error(status: int, body: bytes) -> bytes:
    """An error response body (OpenAI's shape, or text) in Anthropic's shape."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("type") == "error":
        return body  # already Anthropic's
    message = body.decode("utf-8", errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            message = str(error["message"])
        elif isinstance(data.get("detail"), str):
            message = data["detail"]
    return json.dumps(error_body(status, message)).encode()
