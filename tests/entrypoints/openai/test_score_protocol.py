"""The /score, /rerank and /classify request models: what they accept, the 400s they raise
(naming the field), the sequences admission counts for them, and the batch url table."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xlm.entrypoints.openai.admission import request_cost
from xlm.entrypoints.openai.score_protocol import (
    SCORE_ENDPOINTS,
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
)
from xlm.entrypoints.openai.serving_engine import error_from_validation
from xlm.entrypoints.run_batch import ENDPOINTS


def error_of(model, body: dict):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return error_from_validation(info.value.errors())


def test_score_pairs_and_their_cost():
    request = ScoreRequest.model_validate({"text_1": "q", "text_2": ["a", "b", "c"]})
    assert request.pairs() == [("q", "a"), ("q", "b"), ("q", "c")]
    assert request_cost(request) == 3
    n_to_n = ScoreRequest.model_validate({"text_1": ["x", "y"], "text_2": ["a", "b"]})
    assert n_to_n.pairs() == [("x", "a"), ("y", "b")]


@pytest.mark.parametrize(
    "model, body, param, words",
    [
        (ScoreRequest, {"text_1": ["x", "y"], "text_2": ["a"]}, "text_2", "text_1 has 2"),
        (ScoreRequest, {"text_1": "q", "text_2": []}, "text_2", "must not be empty"),
        (ScoreRequest, {"text_1": "q", "text_2": ["a"] * 2049}, "text_2", "at most 2048"),
        (RerankRequest, {"query": "q", "documents": []}, "documents", "must not be empty"),
        (RerankRequest, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "top_n=-1"),
        (ClassificationRequest, {"input": []}, "input", "must not be empty"),
        (ClassificationRequest, {"input": ["a", ""]}, "input", "empty entry"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(model, body, param, words):
    error = error_of(model, body)
    assert int(error.status) == 400 and error.param == param
    assert words in str(error)


def test_an_extra_num_inputs_field_does_not_change_a_completions_cost():
    from xlm.entrypoints.openai.protocol import CompletionRequest

    request = CompletionRequest.model_validate({"prompt": ["a", "b"], "num_inputs": 7})
    assert request_cost(request) == 2


def test_rerank_documents_as_strings_or_text_objects():
    request = RerankRequest.model_validate(
        {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 0}
    )
    assert request.texts() == ["a", "b"]
    assert request.return_documents is True and request.top_n == 0
    assert request_cost(request) == 2


def test_classify_inputs_and_their_cost():
    request = ClassificationRequest.model_validate({"input": ["a b", "c"]})
    assert request.prompts() == ["a b", "c"] and request_cost(request) == 2
    assert ClassificationRequest.model_validate({"input": [1, 2, 3]}).prompts() == [[1, 2, 3]]


def test_batch_urls_are_vllms_and_answered_by_the_score_handler():
    for url in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/classify"):
        assert ENDPOINTS[url] == SCORE_ENDPOINTS[url]
        assert SCORE_ENDPOINTS[url][1] == "score"
    assert SCORE_ENDPOINTS["/v1/rerank"][0] is RerankRequest
