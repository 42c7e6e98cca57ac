"""Routes about the server itself: /health, /ping, /version, /metrics."""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import xlm
from xlm.entrypoints.openai.routes.common import error_response, server_state
from xlm.entrypoints.openai.serving_engine import OpenAIError

router = APIRouter()


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while every engine serves; 503 once one is dead. With data parallelism a dead
    rank answers 503 with `dead_engines` (its ranks) while the other ranks keep serving."""
    engine = server_state(raw_request).engine
    if engine.errored:
        return error_response(
            OpenAIError(
                "The engine is dead",
                HTTPStatus.SERVICE_UNAVAILABLE,
                "service_unavailable",
                code="engine_dead",
            )
        )
    dead = list(getattr(engine, "dead_engines", ()))
    if dead:
        response = error_response(
            OpenAIError(
                f"Data-parallel engine(s) {', '.join(map(str, dead))} dead; the others serve",
                HTTPStatus.SERVICE_UNAVAILABLE,
                "service_unavailable",
                code="engine_dead",
            )
        )
        body = json.loads(response.body)
        body["error"]["dead_engines"] = dead
        return JSONResponse(body, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=200)


@router.get("/ping")
async def ping(raw_request: Request) -> Response:
    return await health(raw_request)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": xlm.__version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    registry = server_state(raw_request).registry
    if registry is None:
        return Response("", media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
