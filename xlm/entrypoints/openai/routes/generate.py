"""The generation routes: /v1/completions and /v1/chat/completions.

Both go through `serve_request`: parse the body, take admission for the request's
sequences (429 past the limit), run the handler (a stream, or a response cancelled when
the client disconnects), and release admission when the response is done.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from xlm.entrypoints.openai.admission import RETRY_AFTER_S, request_cost
from xlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from xlm.entrypoints.openai.routes.common import (
    body_schema,
    error_response,
    parse_body,
    server_state,
    with_disconnect,
)
from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_exception

router = APIRouter()


def _overloaded(admission: Any) -> Response:
    response = error_response(
        OpenAIError(
            f"The server is overloaded: {admission.in_flight} sequences are running or "
            f"waiting (limit {admission.capacity}); retry later",
            HTTPStatus.TOO_MANY_REQUESTS,
            "rate_limit_error",
            code="too_many_requests",
        )
    )
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def serve_request(
    raw_request: Request,
    model: type[BaseModel],
    handler: Callable[[Any], Awaitable[Any]],
) -> Response:
    """Admission, the handler, and the response (JSON, SSE stream, or 499 on disconnect)."""
    request = await parse_body(raw_request, model)
    state = server_state(raw_request)
    admission, engine = state.admission, state.engine
    cost = request_cost(request)
    if not admission.try_acquire(cost):
        return _overloaded(admission)
    streaming = False
    try:
        if engine.errored:
            raise engine.dead_error
        if getattr(request, "stream", False):
            stream = await handler(request)
            streaming = True
            return StreamingResponse(
                admission.guard_stream(stream, cost), media_type="text/event-stream"
            )
        result = await with_disconnect(raw_request, handler(request))
    except Exception as e:
        return error_response(error_from_exception(e))
    finally:
        if not streaming:
            admission.release(cost)
    if result is None:  # client went away
        return Response(status_code=499)
    return JSONResponse(result.model_dump())


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(raw_request: Request) -> Response:
    handler = server_state(raw_request).completion.create_completion
    return await serve_request(raw_request, CompletionRequest, handler)


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(raw_request: Request) -> Response:
    handler = server_state(raw_request).chat.create_chat_completion
    return await serve_request(raw_request, ChatCompletionRequest, handler)
