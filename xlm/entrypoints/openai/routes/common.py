"""What every route shares: OpenAI-shaped errors, body parsing, disconnects, body schemas.

The routes parse their bodies by hand (for 415s and OpenAI-shaped 400s), so FastAPI cannot
see their models: each route declares its model with `body_schema(Model)`, and
`install_body_schemas(app)` puts the models they refer to under components/schemas of
the app's OpenAPI document.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from xlm.entrypoints.openai.engine_setup import ServerState
from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_validation

_SCHEMA_REF = "#/components/schemas/{model}"
_SCHEMA_DEFS: dict[str, Any] = {}


def server_state(raw_request: Request) -> ServerState:
    """The app's ServerState (the engine, handlers, admission, draining)."""
    return raw_request.app.state.xlm


def error_response(error: OpenAIError) -> JSONResponse:
    """An OpenAI-shaped JSON error with its status."""
    return JSONResponse(error.to_response().model_dump(), status_code=int(error.status))


def status_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "NotFoundError",
        405: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


async def parse_body(raw_request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body into a protocol model; OpenAIError (400/415) for anything else."""
    content_type = raw_request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise OpenAIError(
            "Unsupported Media Type: only 'application/json' is allowed",
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        )
    body = await raw_request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(f"The request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error_from_validation(e.errors()) from None


async def with_disconnect(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Run work; cancel it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring `model` as its JSON request body."""
    schema = model.model_json_schema(ref_template=_SCHEMA_REF)
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


def install_body_schemas(app: FastAPI) -> None:
    """Add the models the routes' bodies refer to under the app's components/schemas."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMA_DEFS)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
