"""A Responses request -> the chat completion request that answers it.

`input` items become chat messages (message items, function_call items as an assistant
message's tool_calls, function_call_output items as "tool" messages), `instructions` the
system message, the flat function tools chat's nested ones, `text.format` chat's
response_format. The chat request is then validated and run by the chat path as any
other, so every rule (limits, lengths, sampling, constraints) is the chat endpoint's.
Every shape error here is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from xlm.entrypoints.openai.protocol import ChatCompletionRequest
from xlm.entrypoints.openai.responses_protocol import ResponsesRequest
from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_validation

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_IMAGE_PART = "input_image"
# Fields handed to the chat request under the same name.
_SAME_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "priority",
    "cache_salt",
    "chat_template_kwargs",
    "structured_outputs",
)


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of parts", param="input")
    return "".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    """A text part's text (400 for any other part)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
        raise OpenAIError(
            f"{where} of type {kind!r} is not supported: only text parts "
            f"({', '.join(_TEXT_PARTS)}) with a string 'text', and input_image parts",
            param="input",
        )
    return part["text"]


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: one string, or with `input_image` parts chat's content parts
    (text and image_url, in order; the chat path loads and checks the images)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == _IMAGE_PART for p in content
    ):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != _IMAGE_PART:
            parts.append({"type": "text", "text": _part_text(part, f"{where}.content[{j}]")})
            continue
        url = part.get("image_url")
        if not isinstance(url, str):
            raise OpenAIError(
                f"{where}.content[{j}].image_url must be a string (a data URL, or a URL the "
                "server is allowed to read); file_id is not supported",
                param="input",
            )
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _strings(item: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    for name in names:
        if not isinstance(item.get(name), str):
            raise OpenAIError(f"{where}.{name} must be a string", param="input")


def normalize_item(item: Any, where: str) -> dict[str, Any] | None:
    """One input item in the canonical form the conversation keeps (None: dropped)."""
    if not isinstance(item, dict):
        raise OpenAIError(f"{where} must be an object", param="input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            raise OpenAIError(
                f"{where}.role={role!r} is invalid: allowed {list(_MESSAGE_ROLES)}", param="input"
            )
        content = _message_content(item.get("content"), where)
        return {"type": "message", "role": role, "content": content}
    if kind == "function_call":
        _strings(item, ("call_id", "name", "arguments"), where)
        return {k: item[k] for k in ("type", "call_id", "name", "arguments")}
    if kind == "function_call_output":
        _strings(item, ("call_id",), where)
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, where)
        return {"type": kind, "call_id": item["call_id"], "output": text}
    if kind == "reasoning":
        return None  # earlier reasoning is not shown to the model again
    raise OpenAIError(
        f"{where} has type {kind!r}, which is not supported: allowed 'message', "
        "'function_call', 'function_call_output', 'reasoning'",
        param="input",
    )


def normalize_input(value: str | list[Any]) -> list[dict[str, Any]]:
    """A request's `input` as canonical items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = [normalize_item(item, f"input[{i}]") for i, item in enumerate(value)]
    return [item for item in items if item is not None]


def output_items(output: list[Any]) -> list[dict[str, Any]]:
    """A response's output items in the canonical form (for the next turn's history)."""
    items = [normalize_item(item.model_dump(), "output") for item in output]
    return [item for item in items if item is not None]


def to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of canonical items; a function_call joins the assistant turn before it."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's {"type", "function": {...}}."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise OpenAIError(
                f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}}: "
                "only function tools are supported",
                param="tools",
            )
        keys = ("name", "description", "parameters", "strict")
        function = {k: tool[k] for k in keys if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """tool_choice as chat's: the modes as they are, {"type": "function", "name"} nested."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError("text.format.schema must be an object", param="text")
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise OpenAIError(
        f"text.format type {kind!r} is invalid: allowed 'text', 'json_object', 'json_schema'",
        param="text",
    )


def to_chat_request(
    request: ResponsesRequest, items: list[dict[str, Any]], response_id: str
) -> ChatCompletionRequest:
    """The chat request over the whole conversation (400 for what chat refuses)."""
    if not items:
        raise OpenAIError("input must have at least one message", param="input")
    body: dict[str, Any] = {
        name: getattr(request, name) for name in _SAME_FIELDS if getattr(request, name) is not None
    }
    body.update(
        messages=to_messages(items, request.instructions),
        max_completion_tokens=request.max_output_tokens,
        tools=chat_tools(request.tools),
        tool_choice=chat_tool_choice(request.tool_choice),
        response_format=response_format(request.text),
        request_id=response_id,
        stream=bool(request.stream),
    )
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise error_from_validation(e.errors()) from None
