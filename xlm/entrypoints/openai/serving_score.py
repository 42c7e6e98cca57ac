"""/score, /rerank and /classify: a pooling model's pair scores and label probabilities.

Scoring is LLM.score's (xlm.entrypoints.score_utils): a cross-encoder (single-label
classifier) scores each pair encoded as `tokenizer(text_1, text_2)`, an embedding model
the cosine of the two texts' embeddings. Every input of a request is pooled concurrently
(`serving_embedding.pool_all`).
"""

from __future__ import annotations

from xlm.entrypoints import score_utils
from xlm.entrypoints.openai.protocol import UsageInfo, random_uuid
from xlm.entrypoints.openai.score_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from xlm.entrypoints.openai.serving_embedding import pool_all
from xlm.entrypoints.openai.serving_engine import ServingContext
from xlm.lora.request import LoRARequest
from xlm.pooling_params import PoolingParams


class OpenAIServingScore:
    """Answers /score, /rerank and /classify with the engine's pooling model."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _score(
        self, pairs: list[tuple[str, str]], lora: LoRARequest | None, kind: str
    ) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens pooled for them."""
        ctx = self.ctx
        cross = score_utils.check_scoring_model(ctx.engine.processor.pooling)
        tokenizer = ctx.engine.get_tokenizer()
        ids, params = await ctx.run_blocking(score_utils.score_inputs, tokenizer, pairs, cross)
        outputs = await pool_all(ctx, f"{kind}-{random_uuid()}", ids, params, lora)
        scores = score_utils.pair_scores([o.outputs.data for o in outputs], cross)
        return scores, sum(len(i) for i in ids)

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        """vLLM's /score: one score per (text_1, text_2) pair, in pair order."""
        lora = self.ctx.check_model(request.model)
        scores, num_tokens = await self._score(request.pairs(), lora, "score")
        return ScoreResponse(
            model=self.ctx.response_model(lora),
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        """The documents by relevance to the query, most relevant first, the best top_n."""
        lora = self.ctx.check_model(request.model)
        texts = request.texts()
        pairs = score_utils.score_pairs(request.query, texts)
        scores, num_tokens = await self._score(pairs, lora, "rerank")
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=texts[i]) if request.return_documents else None,
            )
            for i in order
        ]
        return RerankResponse(
            model=self.ctx.response_model(lora),
            usage=RerankUsage(total_tokens=num_tokens),
            results=results,
        )

    async def create_classify(self, request: ClassificationRequest) -> ClassificationResponse:
        """vLLM's /classify: each input's label probabilities and likeliest label."""
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        labels = score_utils.check_classifier(ctx.engine.processor.pooling)
        params = PoolingParams(task="classify")
        prompts = await ctx.run_blocking(ctx.tokenize_prompts, request.prompts(), True)
        outputs = await pool_all(ctx, f"classify-{random_uuid()}", prompts, params, lora)
        data = []
        for i, out in enumerate(outputs):
            result = score_utils.classification(out.outputs.data, labels)
            data.append(
                ClassificationData(
                    index=i,
                    label=result.label,
                    probs=result.probs,
                    num_classes=result.num_classes,
                )
            )
        num_tokens = sum(len(p) for p in prompts)
        return ClassificationResponse(
            model=ctx.response_model(lora),
            data=data,
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
