"""Pydantic models of OpenAI's /v1/embeddings (request and response) and their encoding."""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from xlm.entrypoints.openai.limits import RequestValidationError
from xlm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid
from xlm.pooling_params import PoolingParams

# OpenAI's own cap on inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class PoolingInputRequest(OpenAIBaseModel):
    """A request pooling each of its inputs (embeddings, classification): `input` as a
    string, strings, token ids or token-id lists."""

    model: str | None = None
    input: EmbeddingInput
    user: str | None = None

    @model_validator(mode="after")
    def _check_input(self) -> PoolingInputRequest:
        prompts = self.prompts()
        if not prompts:
            raise RequestValidationError("input must not be empty", "input")
        if len(prompts) > MAX_EMBEDDING_INPUTS:
            raise RequestValidationError(
                f"input has {len(prompts)} entries: at most {MAX_EMBEDDING_INPUTS} are allowed",
                "input",
            )
        for p in prompts:
            if len(p) == 0:
                raise RequestValidationError("input must not contain an empty entry", "input")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each input as a prompt: text, or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(t, int) for t in value):
            return [list(value)]
        return list(value)


class EmbeddingRequest(PoolingInputRequest):
    """An embeddings request (OpenAI's /v1/embeddings, with vLLM's `normalize`)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    # vLLM's extra: whether to L2-normalize (the model's default when None).
    normalize: bool | None = None

    def to_pooling_params(self, default: PoolingParams) -> PoolingParams:
        """The model's default pooling with this request's dimensions and normalize."""
        return PoolingParams(
            pooling_type=default.pooling_type,
            normalize=default.normalize if self.normalize is None else self.normalize,
            dimensions=self.dimensions,
        )


class EmbeddingData(OpenAIBaseModel):
    """One vector: a list of floats, or base64 of little-endian float32."""

    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    """The response of /v1/embeddings."""

    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def encode_embedding(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    vector = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


def build_embedding_response(
    model: str,
    vectors: Sequence[np.ndarray],
    num_prompt_tokens: Sequence[int],
    encoding_format: str,
) -> EmbeddingResponse:
    """The response for vectors in input order, with usage counting their prompt tokens."""
    total = int(sum(num_prompt_tokens))
    return EmbeddingResponse(
        model=model,
        data=[
            EmbeddingData(index=i, embedding=encode_embedding(v, encoding_format))
            for i, v in enumerate(vectors)
        ],
        usage=UsageInfo(prompt_tokens=total, total_tokens=total),
    )
