"""OpenAIServingScore over a stand-in pooling engine whose "model" scores a pair by its
token count: rerank orders by those scores, applies top_n and return_documents; /score
keeps pair order; /classify reports probs, label and num_classes; an embedder's scores are
cosines; the model checks answer before anything is pooled. The real engine's numbers are
checked in tests/models/test_classifier.py and tests/e2e/test_server_score.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import build_tokenizer
from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.engine.exceptions import RequestValidationError
from xlm.engine.processor import PoolingModel
from xlm.entrypoints.openai.limits import RequestLimits
from xlm.entrypoints.openai.score_protocol import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
)
from xlm.entrypoints.openai.serving_engine import ServingContext
from xlm.entrypoints.openai.serving_score import OpenAIServingScore
from xlm.outputs import PoolingOutput, PoolingRequestOutput
from xlm.pooling_params import PoolingParams

DOCS = ["w1", "w1 w2 w3 w4", "w1 w2", "w1 w2 w3"]


class FakePoolingEngine(FakeAsyncEngine):
    """A pooling model: a classifier's one score is tokens / 100; an embedder's vector is
    (tokens, 1)."""

    def __init__(self, labels: tuple[str, ...] | None) -> None:
        super().__init__(build_tokenizer(), max_model_len=64)
        defaults = PoolingParams(task="classify") if labels else PoolingParams()
        self.processor.pooling = PoolingModel(defaults, 2, 256, labels)

    async def encode(self, request, params, request_id, **kwargs):
        n = len(request.prompt_token_ids)
        task = request.pooling_params.task
        data = np.array([n / 100.0] if task == "classify" else [float(n), 1.0], np.float32)
        return PoolingRequestOutput(request_id, None, request.prompt_token_ids, PoolingOutput(data))


def serving(labels=("LABEL_0",)) -> OpenAIServingScore:
    ctx = ServingContext(
        engine=FakePoolingEngine(labels),
        served_model_names=["m"],
        max_model_len=64,
        enable_log_requests=False,
        kv_cache_tokens=None,
        limits=RequestLimits(),
        trust_request_chat_template=False,
        executor=ThreadPoolExecutor(1),
    )
    return OpenAIServingScore(ctx)


def pair_len(a: str, b: str) -> int:
    return len(build_tokenizer()(a, b)["input_ids"])


def test_rerank_orders_by_score_with_top_n_and_documents():
    request = RerankRequest(query="w9", documents=DOCS, top_n=3, return_documents=True)
    response = asyncio.run(serving().create_rerank(request))
    assert [r.index for r in response.results] == [1, 3, 2]
    for r in response.results:
        assert r.relevance_score == pytest.approx(pair_len("w9", DOCS[r.index]) / 100)
        assert r.document.text == DOCS[r.index]
    assert response.usage.total_tokens == sum(pair_len("w9", d) for d in DOCS)
    bare = RerankRequest(query="w9", documents=DOCS, return_documents=False)
    all_docs = asyncio.run(serving().create_rerank(bare))
    assert [r.index for r in all_docs.results] == [1, 3, 2, 0]
    assert all(r.document is None for r in all_docs.results)


def test_score_keeps_pair_order_and_embedders_score_cosines():
    request = ScoreRequest(text_1="w9", text_2=DOCS)
    response = asyncio.run(serving().create_score(request))
    assert [d.index for d in response.data] == [0, 1, 2, 3]
    assert [d.score for d in response.data] == pytest.approx(
        [pair_len("w9", d) / 100 for d in DOCS]
    )
    cosine = asyncio.run(
        serving(labels=None).create_score(ScoreRequest(text_1="w9", text_2="w1 w2"))
    )
    a, b = np.array([1.0, 1.0]), np.array([2.0, 1.0])  # (tokens, 1) of each text
    assert cosine.data[0].score == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_classify_reports_probs_label_and_num_classes():
    response = asyncio.run(serving().create_classify(ClassificationRequest(input=DOCS[:2])))
    assert [d.probs for d in response.data] == [[pytest.approx(0.01)], [pytest.approx(0.04)]]
    assert all(d.label == "LABEL_0" and d.num_classes == 1 for d in response.data)
    assert response.usage.prompt_tokens == 5


def test_models_that_cannot_answer_are_refused_first():
    with pytest.raises(RequestValidationError, match="3 labels"):
        asyncio.run(serving(("a", "b", "c")).create_score(ScoreRequest(text_1="a", text_2="b")))
    with pytest.raises(RequestValidationError, match="embedding model"):
        asyncio.run(serving(labels=None).create_classify(ClassificationRequest(input="w1")))
    generating = serving()
    generating.ctx.engine.processor.pooling = None
    with pytest.raises(RequestValidationError, match="generates text.*does not classify"):
        asyncio.run(generating.create_classify(ClassificationRequest(input="w1")))
    with pytest.raises(RequestValidationError, match="generates text.*does not score"):
        asyncio.run(generating.create_rerank(RerankRequest(query="a", documents=["b"])))
