"""One chat choice's text -> reasoning_content, content and tool_calls (whole or streamed).

The reasoning parser (if the server has one) splits off the reasoning first; the rest
goes to the tool handling of the request's tool_choice: "named" (the text is the
function's arguments JSON), "required" (a JSON array of {"name", "parameters"}), "auto"
(the server's tool-call parser finds the model's own calls) or none.
"""

from __future__ import annotations

import json
from typing import Any

from xlm.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from xlm.entrypoints.openai.structured import named_tool, tool_choice_mode
from xlm.entrypoints.openai.tool_parsers import ParsedToolCall, StreamingToolCalls, ToolParser
from xlm.reasoning import ReasoningParser


def _required_calls(text: str) -> list[ParsedToolCall]:
    """The calls of a tool_choice="required" reply (a JSON array); [] if it is not one."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        calls.append(
            ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        )
    return calls


def _tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


class ChatOutputParser:
    """Parses one choice's output; ``parse`` for a whole text, ``add`` for stream deltas."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_mode: str,
        tool_parser: ToolParser | None = None,
        function_name: str | None = None,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_mode = tool_mode
        self.tool_parser = tool_parser if tool_mode == "auto" else None
        self.function_name = function_name
        self._reasoning_stream = reasoning_parser.stream() if reasoning_parser else None
        self._tool_stream = StreamingToolCalls(self.tool_parser) if self.tool_parser else None
        self._content = ""
        self._named_id: str | None = None
        self.has_tool_calls = False

    # ---- whole outputs ---------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a whole reply."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
        content = content or ""
        calls: list[ParsedToolCall] = []
        if self.tool_mode == "named" and content:
            calls = [ParsedToolCall(self.function_name or "", content)]
        elif self.tool_mode == "required":
            calls = _required_calls(content)
        elif self.tool_parser is not None:
            parsed_content, calls = self.tool_parser.extract(content)
            if calls:
                content = parsed_content or ""
        if calls:
            self.has_tool_calls = True
            return (
                reasoning,
                (None if self.tool_mode in ("named", "required") else content or None),
                _tool_calls(calls),
            )
        return reasoning, content or None, []

    # ---- streamed outputs ------------------------------------------------------------------

    def add(self, delta: str, final: bool) -> tuple[str | None, str | None, list[DeltaToolCall]]:
        """New (reasoning_content, content, tool_call deltas) for one streamed text delta."""
        reasoning, content = None, delta
        if self._reasoning_stream is not None:
            split = self._reasoning_stream.add(delta, final)
            reasoning, content = split.reasoning_content, split.content
        content = content or ""
        if self.tool_mode == "named":
            return reasoning, None, self._named_delta(content)
        if self.tool_mode == "required":
            self._content += content
            if not final:
                return reasoning, None, []
            calls = _required_calls(self._content)
            if not calls:
                return reasoning, self._content or None, []
            self.has_tool_calls = True
            return reasoning, None, self._call_deltas(calls)
        if self._tool_stream is not None:
            new, calls = self._tool_stream.add(content, final)
            if calls:
                self.has_tool_calls = True
            return reasoning, new, self._call_deltas(calls)
        return reasoning, content or None, []

    def _named_delta(self, arguments: str) -> list[DeltaToolCall]:
        if not arguments:
            return []
        if self._named_id is None:
            call = ToolCall(function=FunctionCall(name=self.function_name or "", arguments=""))
            self._named_id = call.id
            self.has_tool_calls = True
            return [
                DeltaToolCall(
                    index=0,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(name=self.function_name, arguments=arguments),
                )
            ]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))]

    @staticmethod
    def _call_deltas(calls: list[ParsedToolCall]) -> list[DeltaToolCall]:
        out = []
        for i, call in enumerate(_tool_calls(calls)):
            out.append(
                DeltaToolCall(
                    index=i,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
            )
        return out


def make_chat_output_parser(
    request: Any, reasoning_parser: ReasoningParser | None, tool_parser: ToolParser | None
) -> ChatOutputParser:
    """The parser for one choice of a chat request."""
    mode = tool_choice_mode(request)
    name = named_tool(request.tool_choice) if mode == "named" else None
    return ChatOutputParser(reasoning_parser, mode, tool_parser, name)
