"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the request, the
response object and its output items.

The request is translated into a chat completion request (`responses_input`); the
output items are built from the chat reply (`serving_responses`, `responses_stream`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from xlm.entrypoints.openai.limits import INT32_MAX, Int32, Seed
from xlm.entrypoints.openai.protocol import OpenAIBaseModel, random_uuid


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    # Stored as `input_` (JSON "input"): admission counts a request's `input` list as one
    # sequence per entry (embeddings), while here the list is one conversation.
    input_: str | list[Any] = Field(alias="input")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM-style extras, handed to the chat request as they are
    seed: Seed | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class InputTokensDetails(OpenAIBaseModel):
    """Input tokens served from the prefix cache."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    """Output tokens spent reasoning."""

    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def from_chat(cls, usage: Any, reasoning_tokens: int = 0) -> ResponseUsage:
        """Responses' usage from chat's (prompt/completion tokens, cached prompt tokens)."""
        details = usage.prompt_tokens_details
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=details.cached_tokens if details is not None else 0
            ),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=usage.total_tokens,
        )


class OutputText(OpenAIBaseModel):
    """A text part of an output message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    """The assistant's text."""

    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    """A function call the model makes; the client answers with a function_call_output."""

    id: str = Field(default_factory=lambda: f"fc_{random_uuid()}")
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: str = "completed"


class ReasoningText(OpenAIBaseModel):
    """The text of a reasoning item."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """The model's reasoning, split off by the server's --reasoning-parser."""

    id: str = Field(default_factory=lambda: f"rs_{random_uuid()}")
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class ResponsesResponse(OpenAIBaseModel):
    """The response object (returned, streamed in events, stored)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    truncation: str = "disabled"
    background: bool = False

    @classmethod
    def skeleton(cls, request: ResponsesRequest, response_id: str, model: str) -> ResponsesResponse:
        """An in-progress response echoing the request's settings."""
        return cls(
            id=response_id,
            model=model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            tools=list(request.tools or []),
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=request.text or {"format": {"type": "text"}},
            reasoning=request.reasoning,
            previous_response_id=request.previous_response_id,
            store=request.store,
            metadata=dict(request.metadata or {}),
            user=request.user,
        )

    def finish(self, finish_reason: str | None, usage: ResponseUsage | None) -> None:
        """Set the final status from the chat finish reason ("length": incomplete)."""
        self.usage = usage
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
        elif finish_reason == "abort":
            self.status = "incomplete"
        else:
            self.status = "completed"
        for item in self.output:  # the last one is where the output was cut
            item.status = "completed"
        if self.output and self.status == "incomplete":
            self.output[-1].status = "incomplete"


class ResponseDeleted(OpenAIBaseModel):
    """DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
