"""POST /v1/responses (through the generation routes' admission), and the stored
responses: GET and DELETE /v1/responses/{response_id}."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xlm.entrypoints.openai.responses_protocol import ResponsesRequest
from xlm.entrypoints.openai.routes.common import body_schema, server_state
from xlm.entrypoints.openai.routes.generate import serve_request

router = APIRouter()


@router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
async def create_response(raw_request: Request) -> Response:
    handler = server_state(raw_request).responses.create_response
    return await serve_request(raw_request, ResponsesRequest, handler)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> JSONResponse:
    return JSONResponse(server_state(raw_request).responses.retrieve(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> JSONResponse:
    deleted = server_state(raw_request).responses.delete(response_id)
    return JSONResponse(deleted.model_dump())
