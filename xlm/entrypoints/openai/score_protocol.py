"""Pydantic models of vLLM's /score, Cohere/Jina's /rerank and vLLM's /classify.

/score: {model, text_1, text_2} -> {id, object: "list", data: [{index, object: "score",
score}], usage}; pairs 1-to-1, 1-to-N or N-to-N (xlm.entrypoints.score_utils).
/rerank: {model, query, documents (strings or {text}), top_n, return_documents} ->
{id, model, usage, results: [{index, relevance_score, document?}]}, most relevant first.
/classify: {model, input} -> {id, object: "list", data: [{index, label, probs,
num_classes}], usage}.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, model_validator

from xlm.entrypoints.openai.embedding_protocol import MAX_EMBEDDING_INPUTS, PoolingInputRequest
from xlm.entrypoints.openai.limits import RequestValidationError
from xlm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid
from xlm.entrypoints.score_utils import score_pairs


class ScoreRequest(OpenAIBaseModel):
    """vLLM's score request: text_1 against text_2 (1-to-1, 1-to-N or N-to-N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None

    @model_validator(mode="after")
    def _check_pairs(self) -> ScoreRequest:
        _check_count(len(self.pairs()), "text_2")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        return score_pairs(self.text_1, self.text_2)

    def num_inputs(self) -> int:
        """Sequences the request puts into the engine (admission counts these)."""
        return len(self.pairs())


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    """The response of /score and /v1/score."""

    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(OpenAIBaseModel):
    """A rerank request (Cohere's and Jina's shape, as vLLM serves it)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    # The best top_n documents (None or 0: all of them).
    top_n: int | None = None
    return_documents: bool = True
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RerankRequest:
        if not self.documents:
            raise RequestValidationError("documents must not be empty", "documents")
        _check_count(len(self.documents), "documents")
        if self.top_n is not None and self.top_n < 0:
            raise RequestValidationError(
                f"top_n={self.top_n} is invalid: allowed an integer >= 0 (0: every document)",
                "top_n",
            )
        score_pairs(self.query, self.texts())  # the same field checks as /score
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def num_inputs(self) -> int:
        return len(self.documents)


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    """The response of /rerank, /v1/rerank and /v2/rerank: the documents by relevance."""

    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationRequest(PoolingInputRequest):
    """vLLM's classify request: `input` as a string, strings or token ids."""


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    """The response of /classify and /v1/classify."""

    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


def _check_count(count: int, param: str) -> None:
    if count > MAX_EMBEDDING_INPUTS:
        raise RequestValidationError(
            f"{param} has {count} entries: at most {MAX_EMBEDDING_INPUTS} are allowed", param
        )


# Batch urls (run-batch, the Ray batch path) -> (request model, ServerState handler, method),
# the paths vLLM's batch format names; the server's routes serve each under these too.
SCORE_ENDPOINTS: dict[str, tuple[type, str, str]] = {
    **{url: (ScoreRequest, "score", "create_score") for url in ("/v1/score", "/score")},
    **{
        url: (RerankRequest, "score", "create_rerank")
        for url in ("/v1/rerank", "/rerank", "/v2/rerank")
    },
    **{
        url: (ClassificationRequest, "score", "create_classify")
        for url in ("/v1/classify", "/classify")
    },
}
