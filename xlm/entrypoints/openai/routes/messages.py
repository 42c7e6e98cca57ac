"""Anthropic's Messages API: POST /v1/messages (through the generation routes' admission)
and POST /v1/messages/count_tokens; `MessagesErrorShape` gives every error under
/v1/messages Anthropic's shape, whichever layer answered it (API key, draining, body
size, validation, the handler)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xlm.entrypoints.openai.messages_protocol import (
    MESSAGES_PATH,
    CountTokensRequest,
    MessagesRequest,
    is_messages_path,
    reshape_error,
)
from xlm.entrypoints.openai.routes.common import body_schema, parse_body, server_state
from xlm.entrypoints.openai.routes.generate import serve_request

router = APIRouter()


@router.post(MESSAGES_PATH, openapi_extra=body_schema(MessagesRequest))
async def messages(raw_request: Request) -> Response:
    handler = server_state(raw_request).messages.create_message
    return await serve_request(raw_request, MessagesRequest, handler)


@router.post(MESSAGES_PATH + "/count_tokens", openapi_extra=body_schema(CountTokensRequest))
async def count_tokens(raw_request: Request) -> JSONResponse:
    request = await parse_body(raw_request, CountTokensRequest)
    response = await server_state(raw_request).messages.count_tokens(request)
    return JSONResponse(response.model_dump())


class MessagesErrorShape:
    """ASGI middleware: an error response (status >= 400) under /v1/messages is rewritten
    into Anthropic's error shape; other paths and successful responses pass untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def reshaping_send(message: dict[str, Any]) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole body is here
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            if body:
                body = reshape_error(start["status"], body)
            headers = [
                (k, v)
                for k, v in start.get("headers", ())
                if k.lower() not in (b"content-length", b"content-type")
            ]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping_send)
