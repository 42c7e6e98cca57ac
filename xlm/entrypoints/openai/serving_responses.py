"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): OpenAI's Responses API as a
translation layer over the chat completions path.

A request becomes one chat request (`responses_input.to_chat_request`: the stored
conversation of `previous_response_id`, then the new input) that `OpenAIServingChat`
validates and runs; its reply (reasoning_content, content, tool_calls, usage) becomes
the response's output items, or, streamed, the Responses event sequence
(`responses_stream`). Results with `store` (the default) are kept in the bounded
`ResponseStore`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from xlm.entrypoints.openai.protocol import ChatCompletionResponse, random_uuid
from xlm.entrypoints.openai.responses_input import (
    normalize_input,
    output_items,
    to_chat_request,
)
from xlm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from xlm.entrypoints.openai.responses_store import DEFAULT_MAX_AGE_S, ResponseStore
from xlm.entrypoints.openai.responses_stream import ResponseEventStream
from xlm.entrypoints.openai.serving_chat import OpenAIServingChat
from xlm.entrypoints.openai.serving_engine import OpenAIError


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    """OpenAI's 404 for a response id that is unknown (or evicted from the store)."""
    return OpenAIError(
        f"Response with id '{response_id}' not found.",
        HTTPStatus.NOT_FOUND,
        "invalid_request_error",
        param=param,
        code="response_not_found",
    )


class OpenAIServingResponses:
    """Handler of the responses endpoints."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    @classmethod
    def from_args(cls, chat: OpenAIServingChat, args: Any) -> OpenAIServingResponses:
        """The handler with the store the server flags bound (run-batch keeps none)."""
        store = ResponseStore(
            max_entries=getattr(args, "responses_store_max_entries", 0),
            max_age_s=getattr(args, "responses_store_max_age", DEFAULT_MAX_AGE_S),
        )
        return cls(chat, store)

    def count_tokens(self, text: str | None) -> int:
        """Tokens of a text (the reasoning's count, which chat's usage does not split off)."""
        if not text:
            return 0
        tokenizer = self.chat.ctx.engine.get_tokenizer()
        return len(tokenizer.encode(text, add_special_tokens=False))

    async def create_response(
        self, request: ResponsesRequest
    ) -> ResponsesResponse | AsyncIterator[str]:
        """Translate, run through chat, and answer (a response, or SSE events)."""
        items: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            items = list(stored.conversation)
        items += normalize_input(request.input_)
        response_id = f"resp_{random_uuid()}"
        chat_request = to_chat_request(request, items, response_id)
        result = await self.chat.create_chat_completion(chat_request)
        model = chat_request.model or self.chat.ctx.model_name
        skeleton = ResponsesResponse.skeleton(request, response_id, model)
        if request.stream:
            events = ResponseEventStream(skeleton, self.count_tokens, lambda r: self.keep(items, r))
            return events.stream(result)
        response = self.from_chat(skeleton, result)
        self.keep(items, response)
        return response

    def from_chat(
        self, response: ResponsesResponse, result: ChatCompletionResponse
    ) -> ResponsesResponse:
        """Fill a skeleton with a whole chat reply's output items and usage."""
        choice = result.choices[0]
        message = choice.message
        response.model = result.model
        if message.reasoning_content:
            text = ReasoningText(text=message.reasoning_content)
            response.output.append(ReasoningItem(content=[text]))
        if message.content:
            response.output.append(OutputMessage(content=[OutputText(text=message.content)]))
        for call in message.tool_calls:
            response.output.append(
                FunctionCallItem(
                    call_id=call.id, name=call.function.name, arguments=call.function.arguments
                )
            )
        reasoning_tokens = self.count_tokens(message.reasoning_content)
        response.finish(
            choice.finish_reason, ResponseUsage.from_chat(result.usage, reasoning_tokens)
        )
        return response

    def keep(self, items: list[dict[str, Any]], response: ResponsesResponse) -> None:
        """Store a finished response (store=true) with its conversation."""
        if response.store and response.status != "failed":
            conversation = items + output_items(response.output)
            self.store.put(response.id, response.model_dump(), conversation)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}: a stored response (404 if not kept)."""
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> ResponseDeleted:
        """DELETE /v1/responses/{id} (404 if not kept)."""
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return ResponseDeleted(id=response_id)
