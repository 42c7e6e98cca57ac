"""Routes about the served model: /v1/models, /tokenize, /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xlm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from xlm.entrypoints.openai.routes.common import body_schema, parse_body, server_state

router = APIRouter()


@router.get("/v1/models")
async def models(raw_request: Request) -> JSONResponse:
    state = server_state(raw_request)
    return JSONResponse(state.models.show_available_models().model_dump())


@router.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
async def tokenize(raw_request: Request) -> JSONResponse:
    state = server_state(raw_request)
    request = await parse_body(raw_request, TokenizeRequest)
    response = await state.ctx.run_blocking(state.models.tokenize, request)
    return JSONResponse(response.model_dump(exclude_none=True))


@router.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
async def detokenize(raw_request: Request) -> JSONResponse:
    state = server_state(raw_request)
    request = await parse_body(raw_request, DetokenizeRequest)
    return JSONResponse(state.models.detokenize(request).model_dump())
