"""Reasoning parsers: split a reasoning model's ``<think>...</think>`` from its answer.

Text-based, so they work whatever the tokenizer makes of the tags. Two behaviours, as in
vLLM: ``deepseek_r1`` (the R1 distills' template opens ``<think>`` in the prompt, so all
text before ``</think>`` is reasoning, a leading ``<think>`` dropped; no ``</think>`` yet:
all reasoning) and ``qwen3`` (reasoning only inside an explicit ``<think>...</think>``
at the start of the output; no tag: all content). The engine core uses ``end`` to apply a
structured-output constraint only once the reasoning has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReasoningDelta:
    """What one streamed step adds to the reasoning and to the content."""

    reasoning_content: str | None = None
    content: str | None = None


class ReasoningParser:
    """Splits output text at the think tags; ``stream`` keeps state between deltas."""

    name = ""
    start = "<think>"
    end = "</think>"
    # Whether text before any tag counts as reasoning (the tag was opened in the prompt).
    implicit_start = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif self.implicit_start:
            body = text
        else:
            return None, text or None
        if self.end not in body:
            return body or None, None
        reasoning, content = body.split(self.end, 1)
        return reasoning or None, content or None

    def is_reasoning_end(self, text: str) -> bool:
        """Whether reasoning is over at the end of ``text`` (a prompt's tail): True when
        the last ``</think>`` comes after the last ``<think>``."""
        return text.rfind(self.end) > text.rfind(self.start) if self.end in text else False

    def stream(self) -> StreamingReasoning:
        """A fresh incremental splitter for one streamed output."""
        return StreamingReasoning(self)


@dataclass
class StreamingReasoning:
    """Incremental split: holds back text that may be the start of a tag."""

    parser: ReasoningParser
    text: str = ""
    emitted_reasoning: int = field(default=0)
    emitted_content: int = field(default=0)

    def add(self, delta: str, final: bool = False) -> ReasoningDelta:
        """Feed new text; returns only the new parts (nothing held back when ``final``)."""
        self.text += delta
        text = self.text
        if not final:
            # Hold back a trailing partial tag ("<", "</thi", ...) until it resolves.
            for tag in (self.parser.start, self.parser.end):
                for n in range(len(tag) - 1, 0, -1):
                    if text.endswith(tag[:n]):
                        text = text[:-n]
                        break
            if not self.parser.implicit_start and self.parser.start.startswith(self.text.lstrip()):
                text = ""  # the output may still open with <think>
        reasoning, content = self.parser.extract(text)
        reasoning, content = reasoning or "", content or ""
        out = ReasoningDelta()
        if len(reasoning) > self.emitted_reasoning:
            out.reasoning_content = reasoning[self.emitted_reasoning :]
            self.emitted_reasoning = len(reasoning)
        if len(content) > self.emitted_content:
            out.content = content[self.emitted_content :]
            self.emitted_content = len(content)
        return out


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: reasoning until ``</think>``."""

    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning inside a leading ``<think>...</think>``."""

    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"reasoning_parser={name!r} is invalid: allowed {sorted(REASONING_PARSERS)}"
        )
    return cls()
