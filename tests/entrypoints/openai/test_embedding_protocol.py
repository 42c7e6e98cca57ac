"""/v1/embeddings request parsing and response encoding, checked with the openai client's
own response types and its base64 decoding."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse
from pydantic import ValidationError

from xlm.entrypoints.openai.embedding_protocol import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingRequest,
    build_embedding_response,
)
from xlm.pooling_params import PoolingParams, PoolingType


@pytest.mark.parametrize(
    "value, prompts",
    [
        ("hello", ["hello"]),
        (["a", "b c"], ["a", "b c"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_input_shapes(value, prompts):
    assert EmbeddingRequest(input=value).prompts() == prompts


@pytest.mark.parametrize(
    "body, match",
    [
        ({"input": []}, "input must not be empty"),
        ({"input": [[1], []]}, "empty entry"),
        ({"input": ""}, "empty entry"),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, f"at most {MAX_EMBEDDING_INPUTS}"),
        ({"input": {"a": 1}}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
    ],
)
def test_bad_requests(body, match):
    with pytest.raises(ValidationError, match=match):
        EmbeddingRequest.model_validate(body)


def test_pooling_params_from_request():
    default = PoolingParams(pooling_type="mean", normalize=True)
    p = EmbeddingRequest(input="x", dimensions=8, normalize=False).to_pooling_params(default)
    assert (p.pooling_type, p.normalize, p.dimensions) == (PoolingType.MEAN, False, 8)
    assert EmbeddingRequest(input="x").to_pooling_params(default).normalize is True


def test_response_parses_with_openai_types_and_base64_equals_float():
    rng = np.random.default_rng(0)
    vectors = [rng.normal(size=n).astype(np.float32) for n in (8, 8, 4)]
    counts = [3, 5, 2]
    as_float = build_embedding_response("m", vectors, counts, "float").model_dump()
    as_b64 = build_embedding_response("m", vectors, counts, "base64").model_dump()
    parsed = CreateEmbeddingResponse.model_validate(as_float)
    assert parsed.usage.prompt_tokens == parsed.usage.total_tokens == 10
    assert [d.index for d in parsed.data] == [0, 1, 2]
    for d, b, v in zip(parsed.data, as_b64["data"], vectors):
        np.testing.assert_array_equal(np.asarray(d.embedding, np.float32), v)
        # The openai client decodes base64 as little-endian float32.
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, v)
