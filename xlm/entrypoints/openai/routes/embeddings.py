"""POST /v1/embeddings (a pooling model's vectors), through the generation routes' admission."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xlm.entrypoints.openai.embedding_protocol import EmbeddingRequest
from xlm.entrypoints.openai.routes.common import body_schema, server_state
from xlm.entrypoints.openai.routes.generate import serve_request

router = APIRouter()


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest))
async def embeddings(raw_request: Request) -> Response:
    handler = server_state(raw_request).embedding.create_embedding
    return await serve_request(raw_request, EmbeddingRequest, handler)
