"""A streamed chat reply -> the Responses API's server-sent events.

The chat path streams chunks (`data: {...}` lines: reasoning_content, content and
tool_calls deltas, a finish_reason, then the usage chunk, or an error object); this
module turns them into the documented event sequence, each event with its `type` and a
`sequence_number` counting from 0:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
        response.reasoning_text.done, response.content_part.done
      message: response.content_part.added, response.output_text.delta ...,
        response.output_text.done, response.content_part.done
      function call: response.function_call_arguments.delta ...,
        response.function_call_arguments.done
    response.output_item.done,
    then response.completed (or response.incomplete when max_output_tokens cut it or
    the server aborted it at shutdown, response.failed when the engine failed it).

As OpenAI's, each event has an `event:` line naming its type, and no `[DONE]` follows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from xlm.entrypoints.openai.protocol import UsageInfo
from xlm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesResponse,
    ResponseUsage,
)
from xlm.entrypoints.openai.serving_engine import SSE_DONE, sse

_DATA = "data: "


def chat_chunk(event: str) -> dict[str, Any] | None:
    """The JSON of one chat SSE event (None for the closing [DONE])."""
    if event == SSE_DONE:
        return None
    return json.loads(event[len(_DATA) :])


class ResponseEventStream:
    """One streamed response: the items so far and the events' sequence numbers."""

    def __init__(
        self,
        response: ResponsesResponse,
        count_tokens: Callable[[str], int],
        on_done: Callable[[ResponsesResponse], None],
    ) -> None:
        self.response = response
        self.count_tokens = count_tokens
        self.on_done = on_done
        self.sequence_number = 0
        self.open: OutputItem | None = None
        self.call_index: int | None = None  # the chat tool-call index of the open call
        self.finish_reason: str | None = None
        self.usage: UsageInfo | None = None
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event of the given type (named in its `event:` line too, as OpenAI's)."""
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(data)}"

    def _snapshot(self, kind: str) -> str:
        return self.event(kind, response=self.response.model_dump())

    async def stream(self, chat_stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """The events of the whole response, ending with its terminal event."""
        yield self._snapshot("response.created")
        yield self._snapshot("response.in_progress")
        try:
            async for raw in chat_stream:
                chunk = chat_chunk(raw)
                if chunk is None:
                    break
                if "error" in chunk:
                    for event in self._fail(chunk["error"]):
                        yield event
                    return
                for event in self._on_chunk(chunk):
                    yield event
            for event in self._close():
                yield event
            for event in self._finish():
                yield event
        finally:
            await chat_stream.aclose()

    def _on_chunk(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = UsageInfo.model_validate(chunk["usage"])
        self.response.model = chunk.get("model", self.response.model)
        events: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    # ---- items ------------------------------------------------------------------------------

    def _add(self, item: OutputItem) -> list[str]:
        events = self._close()
        self.response.output.append(item)
        self.open = item
        item.status = "in_progress"
        return events + [
            self.event(
                "response.output_item.added",
                output_index=self._index(),
                item=item.model_dump(),
            )
        ]

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open.id, "output_index": self._index()}

    def _part_added(self, part: Any) -> str:
        return self.event(
            "response.content_part.added", content_index=0, part=part.model_dump(), **self._where()
        )

    def _reasoning(self, delta: str) -> list[str]:
        events: list[str] = []
        if not isinstance(self.open, ReasoningItem):
            events += self._add(ReasoningItem())
            self.open.content.append(ReasoningText(text=""))
            events.append(self._part_added(self.open.content[0]))
        self.open.content[0].text += delta
        self.reasoning += delta
        return events + [
            self.event(
                "response.reasoning_text.delta", content_index=0, delta=delta, **self._where()
            )
        ]

    def _text(self, delta: str) -> list[str]:
        events: list[str] = []
        if not isinstance(self.open, OutputMessage):
            events += self._add(OutputMessage())
            self.open.content.append(OutputText(text=""))
            events.append(self._part_added(self.open.content[0]))
        self.open.content[0].text += delta
        return events + [
            self.event(
                "response.output_text.delta",
                content_index=0,
                delta=delta,
                logprobs=[],
                **self._where(),
            )
        ]

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        if not isinstance(self.open, FunctionCallItem) or call.get("index") != self.call_index:
            item = FunctionCallItem(call_id=call.get("id") or "", name=function.get("name") or "")
            events += self._add(item)
            self.call_index = call.get("index")
        arguments = function.get("arguments") or ""
        if arguments:
            self.open.arguments += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta", delta=arguments, **self._where()
                )
            )
        return events

    def _close(self) -> list[str]:
        """The closing events of the open item, if any."""
        item = self.open
        if item is None:
            return []
        where = self._where()
        cut = self.finish_reason in ("length", "abort")  # only the last item can be cut
        item.status = "incomplete" if cut else "completed"
        if isinstance(item, FunctionCallItem):
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    arguments=item.arguments,
                    name=item.name,
                    **where,
                )
            ]
        else:
            part = item.content[0]
            if isinstance(item, OutputMessage):
                done = self.event(
                    "response.output_text.done",
                    content_index=0,
                    text=part.text,
                    logprobs=[],
                    **where,
                )
            else:
                done = self.event(
                    "response.reasoning_text.done", content_index=0, text=part.text, **where
                )
            part_done = self.event(
                "response.content_part.done", content_index=0, part=part.model_dump(), **where
            )
            events = [done, part_done]
        self.open = None
        self.call_index = None
        return events + [
            self.event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=item.model_dump(),
            )
        ]

    # ---- the end ----------------------------------------------------------------------------

    def _finish(self) -> list[str]:
        usage = None
        if self.usage is not None:
            usage = ResponseUsage.from_chat(self.usage, self.count_tokens(self.reasoning))
        self.response.finish(self.finish_reason, usage)
        self.on_done(self.response)
        if self.response.status == "completed":
            return [self._snapshot("response.completed")]
        return [self._snapshot("response.incomplete")]

    def _fail(self, error: dict[str, Any]) -> list[str]:
        self.response.status = "failed"
        self.response.error = {"code": "server_error", "message": str(error.get("message"))}
        return [self._snapshot("response.failed")]
