"""Anthropic Messages request -> the chat request that serves it, and the chat response ->
Anthropic's message.

The chat request is validated once, by ChatCompletionRequest and the chat handler (the
same processor builds its EngineCoreRequest); this module only moves fields across.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from xlm.entrypoints.openai.messages_protocol import (
    ImageBlockParam,
    MessageParam,
    MessagesConversation,
    MessagesResponse,
    MessagesUsage,
    TextBlockParam,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from xlm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_validation

_IMAGES_REFUSED = "image blocks are not supported in a tool_result: put the image in the user turn"


def _image_part(block: ImageBlockParam, where: str) -> dict[str, Any]:
    """An Anthropic image block as chat's image_url part: a base64 source as a data URL,
    a url source as it is (the chat path loads and checks the image under the media
    policy, and refuses images to a text-only model)."""
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise OpenAIError(
                f"{where}: the image block's source.media_type={media_type!r} is invalid: "
                "an image/* type "
                "(image/jpeg, image/png, image/gif, image/webp)",
                param="messages",
            )
        if not isinstance(data, str):
            raise OpenAIError(
                f"{where}: the image block's source.data must be a base64 string",
                param="messages",
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise OpenAIError(
        f"{where}: the image block's source of type {kind!r} is invalid: allowed 'base64' "
        "(with media_type and data) and 'url' (with url)",
        param="messages",
    )


def _text_of(blocks: str | list[Any] | None, where: str) -> str:
    """The text of a string or a list of text blocks (400 for an image block)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for block in blocks:
        if isinstance(block, ImageBlockParam):
            raise OpenAIError(f"{where}: {_IMAGES_REFUSED}", param="messages")
        parts.append(block.text)
    return "".join(parts)


def _assistant_turn(message: MessageParam, where: str) -> dict[str, Any]:
    """An assistant turn: its text, and its tool_use blocks as tool_calls."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls = [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, ThinkingBlockParam):  # earlier reasoning is dropped
            raise OpenAIError(
                f"{where}.content[{j}]: a {block.type!r} block cannot be in an assistant turn",
                param="messages",
            )
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(message: MessageParam, where: str) -> list[dict[str, Any]]:
    """A user turn: tool_result blocks become "tool" messages, the text (and images, as
    image_url parts in order) a user message."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    turns: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlockParam):
            content = _text_of(block.content, f"{where}.content[{j}]")
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ImageBlockParam):
            parts.append(_image_part(block, f"{where}.content[{j}]"))
        else:
            raise OpenAIError(
                f"{where}.content[{j}]: a {block.type!r} block cannot be in a user turn",
                param="messages",
            )
    if any(p["type"] == "image_url" for p in parts):
        turns.append({"role": "user", "content": parts})
    elif parts or not turns:
        turns.append({"role": "user", "content": "".join(p["text"] for p in parts)})
    return turns


def chat_messages(request: MessagesConversation) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first, then each turn."""
    out: list[dict[str, Any]] = []
    if request.system:
        out.append({"role": "system", "content": _text_of(request.system, "system")})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if message.role == "assistant":
            out.append(_assistant_turn(message, where))
        else:
            out.extend(_user_turns(message, where))
    return out


def _chat_tools(request: MessagesConversation) -> tuple[list[dict[str, Any]] | None, Any]:
    """(tools, tool_choice) in the chat request's form."""
    tools = None
    if request.tools:
        tools = []
        for tool in request.tools:
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
    choice = request.tool_choice
    if choice is None:
        return tools, None
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError('tool_choice of type "tool" needs a name', param="tool_choice")
        return tools, {"type": "function", "function": {"name": choice.name}}
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(request: MessagesConversation, **fields: Any) -> ChatCompletionRequest:
    """The chat request carrying a Messages (or count_tokens) request; `fields` are the
    sampling fields, in the chat request's names (None: unset)."""
    tools, tool_choice = _chat_tools(request)
    body = {
        "model": request.model,
        "messages": chat_messages(request),
        "tools": tools,
        "tool_choice": tool_choice,
        **fields,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        raise error_from_validation(e.errors()) from None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the tool_use block's input object ({} if not an object,
    e.g. cut short by max_tokens)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def block_id(chat_id: str, prefix: str, anthropic_prefix: str) -> str:
    """An Anthropic id from a chat one (call_X -> toolu_X, chatcmpl-X -> msg_X)."""
    return anthropic_prefix + chat_id.removeprefix(prefix)


def stop_reason(finish_reason: str | None, stop: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat choice's finish_reason and stop_reason."""
    if finish_reason == "abort":
        raise OpenAIError("The request was aborted: the server is shutting down", status=503)
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):  # the stop string matched
        return "stop_sequence", stop
    return "end_turn", None


def to_message(response: ChatCompletionResponse) -> MessagesResponse:
    """Anthropic's message from the chat response (one choice)."""
    choice = response.choices[0]
    message = choice.message
    content: list[dict[str, Any]] = []
    if message.reasoning_content:
        content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        content.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": block_id(call.id, "call_", "toolu_"),
                "name": call.function.name,
                "input": tool_input(call.function.arguments),
            }
        )
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    usage = response.usage
    return MessagesResponse(
        id=block_id(response.id, "chatcmpl-", "msg_"),
        model=response.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=MessagesUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens
        ),
    )
