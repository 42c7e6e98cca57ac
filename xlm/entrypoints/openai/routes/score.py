"""vLLM's pooling-model routes beyond embeddings: /score, /rerank (Cohere/Jina shape) and
/classify, each under the paths vLLM serves it, through the generation routes' admission
(one sequence per pair, document or input)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xlm.entrypoints.openai.routes.common import body_schema, server_state
from xlm.entrypoints.openai.routes.generate import serve_request
from xlm.entrypoints.openai.score_protocol import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
)

router = APIRouter()
# The paths vLLM serves outside /v1: refused with 503 while draining, as /v1/* are.
UNVERSIONED_PATHS = frozenset({"/score", "/rerank", "/v2/rerank", "/classify"})


@router.post("/score", openapi_extra=body_schema(ScoreRequest))
@router.post("/v1/score", openapi_extra=body_schema(ScoreRequest))
async def score(raw_request: Request) -> Response:
    handler = server_state(raw_request).score.create_score
    return await serve_request(raw_request, ScoreRequest, handler)


@router.post("/rerank", openapi_extra=body_schema(RerankRequest))
@router.post("/v1/rerank", openapi_extra=body_schema(RerankRequest))
@router.post("/v2/rerank", openapi_extra=body_schema(RerankRequest))
async def rerank(raw_request: Request) -> Response:
    handler = server_state(raw_request).score.create_rerank
    return await serve_request(raw_request, RerankRequest, handler)


@router.post("/classify", openapi_extra=body_schema(ClassificationRequest))
@router.post("/v1/classify", openapi_extra=body_schema(ClassificationRequest))
async def classify(raw_request: Request) -> Response:
    handler = server_state(raw_request).score.create_classify
    return await serve_request(raw_request, ClassificationRequest, handler)
