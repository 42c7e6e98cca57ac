"""POST /v1/embeddings: inputs -> a pooling model's vectors, in OpenAI's response shape."""

from __future__ import annotations

import asyncio
from typing import Any

from xlm.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    build_embedding_response,
)
from xlm.entrypoints.openai.protocol import random_uuid
from xlm.entrypoints.openai.serving_engine import (
    OpenAIError,
    ServingContext,
)
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.pooling_params import PoolingParams

logger = init_logger(__name__)


class OpenAIServingEmbedding:
    """Embeds every input of a request concurrently (they pack into the same steps)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Validate every input first (400 names the limit), then embed them all."""
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        processor = ctx.engine.processor
        if processor.pooling is None:
            raise OpenAIError(
                "This model generates text (runner 'generate'): it serves /v1/completions "
                "and /v1/chat/completions, not /v1/embeddings; start it with --runner pooling "
                "to serve embeddings",
                param="model",
            )
        prompts = await ctx.run_blocking(ctx.tokenize_prompts, request.prompts(), True)
        params = request.to_pooling_params(processor.pooling.defaults)
        outputs = await pool_all(ctx, f"embd-{random_uuid()}", prompts, params, lora)
        return build_embedding_response(
            ctx.response_model(lora),
            [o.outputs.data for o in outputs],
            [len(ids) for ids in prompts],
            request.encoding_format,
        )


async def pool_all(
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params: PoolingParams | None,
    lora: LoRARequest | None,
) -> list[Any]:
    """Pool every prompt concurrently (they pack into the same steps): each is checked first
    (a 400 names the limit), and all are aborted on a failure or a client disconnect."""
    core_requests = [
        ctx.process_inputs(
            f"{request_id}-{i}",
            ids,
            None,
            pooling_params=params,
            pooling=True,
            lora_request=lora,
        )
        for i, ids in enumerate(prompts)
    ]
    if ctx.enable_log_requests:
        logger.info("Received request %s: %d inputs, %s", request_id, len(prompts), params)
    tasks = [asyncio.ensure_future(ctx.engine.encode(r, None, r.request_id)) for r in core_requests]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:  # a failure or a disconnect: abort every input still running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
