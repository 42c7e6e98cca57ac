"""Routes about the served model: /v1/models, /tokenize, /detokenize; and `lora_router`,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter, included only with
--allow-runtime-lora-updating."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from xlm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from xlm.entrypoints.openai.routes.common import body_schema, parse_body, server_state

router = APIRouter()
lora_router = APIRouter()


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


@lora_router.post("/v1/load_lora_adapter", openapi_extra=body_schema(LoadLoRAAdapterRequest))
async def load_lora_adapter(raw_request: Request) -> PlainTextResponse:
    state = server_state(raw_request)
    request = await parse_body(raw_request, LoadLoRAAdapterRequest)
    return PlainTextResponse(await state.models.load_lora_adapter(request))


@lora_router.post("/v1/unload_lora_adapter", openapi_extra=body_schema(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(raw_request: Request) -> PlainTextResponse:
    state = server_state(raw_request)
    request = await parse_body(raw_request, UnloadLoRAAdapterRequest)
    return PlainTextResponse(await state.models.unload_lora_adapter(request))
