"""Tool-call parsers for tool_choice="auto": find the model's own tool calls in its text.

``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks, text around them is content. ``llama3_json``: the whole reply is
one or more JSON objects ``{"name": ..., "parameters"|"arguments": {...}}`` (separated by
``;``), optionally after ``<|python_tag|>``. Text that does not parse stays content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _call_of(obj: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            return ParsedToolCall(obj["name"], text)
    return ParsedToolCall(obj["name"], "{}")


class ToolParser:
    """Splits a whole reply into content and tool calls."""

    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a whole reply; calls empty when there are none."""
        raise NotImplementedError

    def start_marker(self, text: str) -> int:
        """Where tool calls may begin in text so far (-1: not yet); streaming holds text
        from there on until the reply ends or a call completes."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>...</tool_call>`` blocks of JSON."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls: list[ParsedToolCall] = []
        for match in self._block.finditer(text):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            try:
                call = _call_of(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text or None, []  # malformed: leave the whole reply as content
            calls.append(call)
        if not calls:
            return text or None, []
        content = self._block.sub("", text).strip()
        return content or None, calls

    def start_marker(self, text: str) -> int:
        index = text.find(self.start)
        if index >= 0:
            return index
        for n in range(len(self.start) - 1, 0, -1):  # a marker may be arriving
            if text.endswith(self.start[:n]):
                return len(text) - n
        return -1


class Llama3JsonToolParser(ToolParser):
    """A reply that is JSON function calls, e.g. ``{"name": "f", "parameters": {...}}``."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :].lstrip()
        if not body.startswith("{"):
            return text or None, []
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text or None, []
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return text or None, []
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def start_marker(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped:
            return 0
        if stripped.startswith("{") or self.tag.startswith(stripped[: len(self.tag)]):
            return 0
        return -1


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser={name!r} is invalid: allowed {sorted(TOOL_PARSERS)}")
    return cls()


@dataclass
class StreamingToolCalls:
    """Incremental auto-mode parsing: content streams until a tool call may begin; from
    there the text is held and the calls go out when the reply ends."""

    parser: ToolParser
    text: str = ""
    emitted_content: int = 0
    calls: list[ParsedToolCall] = field(default_factory=list)

    def add(self, delta: str, final: bool) -> tuple[str | None, list[ParsedToolCall]]:
        """New content to send, and the calls found (only when ``final``)."""
        self.text += delta
        if final:
            content, calls = self.parser.extract(self.text)
            self.calls = calls
            if calls:
                # Content before the first call went out already; send what is left of it.
                already = self.text[: self.emitted_content].strip()
                rest = content or ""
                new = rest[len(already) :] if rest.startswith(already) else ""
                self.emitted_content = len(self.text)
                return new.strip() or None, calls
            new = self.text[self.emitted_content :]
            self.emitted_content = len(self.text)
            return new or None, []
        marker = self.parser.start_marker(self.text)
        limit = len(self.text) if marker < 0 else marker
        if limit <= self.emitted_content:
            return None, []
        new = self.text[self.emitted_content : limit]
        self.emitted_content = limit
        return new, []
