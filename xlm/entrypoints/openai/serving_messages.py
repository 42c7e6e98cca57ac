"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat
handler.

A Messages request is translated into a chat request (`messages_translate`) and answered
by `OpenAIServingChat` itself, so it is validated, templated, admitted and metered exactly
like a chat completion; the answer is translated back: a message, or the chat stream's
chunks re-cut into Anthropic's events (message_start, ping, content_block_start /
_delta / _stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from xlm.entrypoints.openai.messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    error_body,
)
from xlm.entrypoints.openai.messages_translate import (
    block_id,
    chat_request,
    stop_reason,
    to_message,
)
from xlm.entrypoints.openai.serving_chat import OpenAIServingChat
from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_exception


def event(kind: str, **data: Any) -> str:
    """One Anthropic server-sent event: the `event:` line and the JSON with its `type`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessagesStream:
    """Turns the chat stream's chunks (dicts) into Anthropic's events, block by block."""

    def __init__(self) -> None:
        self.started = False
        self.finished = False  # an error event or message_stop went out
        self.block: tuple[str, int] | None = None  # (kind, chat tool-call index) of the open block
        self.index = -1
        self.finish_reason: str | None = None
        self.stop: Any = None
        self.usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}

    def feed(self, chunk: dict[str, Any]) -> Iterator[str]:
        """The events of one chat chunk."""
        if "error" in chunk:
            yield from self.fail(chunk["error"].get("message", "error"), chunk["error"])
            return
        usage = chunk.get("usage")
        if usage:
            self.usage = {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
            }
        for choice in chunk.get("choices", ()):
            idle = not _has_output(choice["delta"]) and choice.get("finish_reason") is None
            if idle and not self.started:
                continue  # the role chunk: the first chunk with usage starts the message
            yield from self.start(chunk)
            yield from self.delta(choice["delta"])
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.stop = choice["finish_reason"], choice.get("stop_reason")

    def start(self, chunk: dict[str, Any]) -> Iterator[str]:
        if self.started:
            return
        self.started = True
        message = MessagesResponse(
            id=block_id(chunk["id"], "chatcmpl-", "msg_"),
            model=chunk["model"],
            content=[],
            stop_reason=None,
            usage=dict(self.usage, output_tokens=0),
        )
        yield event("message_start", message=message.model_dump())
        yield event("ping")

    def delta(self, delta: dict[str, Any]) -> Iterator[str]:
        if delta.get("reasoning_content"):
            block = {"type": "thinking", "thinking": "", "signature": ""}
            yield from self.open(("thinking", -1), block)
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            yield event("content_block_delta", index=self.index, delta=thinking)
        if delta.get("content"):
            yield from self.open(("text", -1), {"type": "text", "text": ""})
            text = {"type": "text_delta", "text": delta["content"]}
            yield event("content_block_delta", index=self.index, delta=text)
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):
                block = {
                    "type": "tool_use",
                    "id": block_id(call["id"], "call_", "toolu_"),
                    "name": function.get("name") or "",
                    "input": {},
                }
                yield from self.open(("tool_use", call["index"]), block)
            if function.get("arguments"):
                partial = {"type": "input_json_delta", "partial_json": function["arguments"]}
                yield event("content_block_delta", index=self.index, delta=partial)

    def open(self, block: tuple[str, int], content_block: dict[str, Any]) -> Iterator[str]:
        """Start a content block unless it is the one open; close the open one first."""
        if self.block == block:
            return
        yield from self.close()
        self.block = block
        self.index += 1
        yield event("content_block_start", index=self.index, content_block=content_block)

    def close(self) -> Iterator[str]:
        if self.block is not None:
            yield event("content_block_stop", index=self.index)
            self.block = None

    def end(self) -> Iterator[str]:
        """The events after the chat stream's last chunk."""
        if self.finished:
            return
        try:
            reason, sequence = stop_reason(self.finish_reason, self.stop)
        except OpenAIError as e:  # aborted at shutdown
            yield from self.fail(e.message, {"type": "service_unavailable"}, status=503)
            return
        if not self.started:
            yield from self.fail("The stream ended before any output", {})
            return
        yield from self.close()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", delta=delta, usage=self.usage)
        yield event("message_stop")
        self.finished = True

    def fail(self, message: str, error: dict[str, Any], status: int | None = None) -> Iterator[str]:
        """An error event (Anthropic's stream ends with it)."""
        if status is None:
            status = 500 if error.get("type") == "server_error" else 400
        yield from self.close()
        yield event("error", error=error_body(status, message)["error"])
        self.finished = True


def _has_output(delta: dict[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def translate_stream(chat_stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Anthropic's events from the chat handler's SSE stream (`data: {...}` lines)."""
    state = MessagesStream()
    try:
        async for line in chat_stream:
            data = line.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            for out in state.feed(json.loads(data)):
                yield out
        for out in state.end():
            yield out
    except Exception as e:  # a fault here, never a dropped connection without an event
        error = error_from_exception(e)
        for out in state.fail(error.message, {}, status=int(error.status)):
            yield out
    finally:
        aclose = getattr(chat_stream, "aclose", None)
        if aclose is not None:
            await aclose()


class AnthropicServingMessages:
    """Handler of the Messages endpoints, over the chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(
        self, request: MessagesRequest
    ) -> MessagesResponse | AsyncIterator[str]:
        """Answer a Messages request (a message, or an SSE stream of events)."""
        user = (request.metadata or {}).get("user_id")
        chat = chat_request(
            request,
            max_tokens=request.max_tokens,
            stop=request.stop_sequences,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            user=user if isinstance(user, str) else None,
            stream=bool(request.stream),
            stream_options={"include_usage": True, "continuous_usage_stats": True}
            if request.stream
            else None,
        )
        result = await self.chat.create_chat_completion(chat)
        if request.stream:
            return translate_stream(result)
        return to_message(result)

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt's token count, rendered through the chat template as a request would be."""
        ctx = self.chat.ctx
        ctx.check_model(request.model)
        prompt_ids, _ = await ctx.run_blocking(self.chat.render, chat_request(request))
        return CountTokensResponse(input_tokens=len(prompt_ids))
