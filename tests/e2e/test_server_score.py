"""/score, /rerank and /classify on `xlm serve` with a tiny Llama cross-encoder (a
single-label LlamaForSequenceClassification): the numbers equal LLM.score/LLM.classify
(themselves equal to transformers, tests/models/test_classifier.py); rerank sorts by those
scores and applies top_n and return_documents; bad inputs get 4xx in OpenAI's error shape;
a generating model refuses with a 400 naming the problem; schemathesis finds no 5xx."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

import xlm
from tests.e2e.conftest import API_KEY
from tests.e2e.server_utils import RemoteServer, fuzz_for_server_errors
from tests.models.test_classifier import write_tiny_classifier

NAME = "tiny-reranker"
FLAGS = ["--served-model-name", NAME, "--token-buckets", "32,256"]
QUERY = "w1 w2 w3"
DOCS = ["w4 w5", "w6 w7 w8 w9", "w10", "w3 w2 w1 w0 w11", "w12 w13"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_classifier("llama", str(tmp_path_factory.mktemp("reranker")), 1)


@pytest.fixture(scope="module")
def score_server(model_dir):
    with RemoteServer(FLAGS, model=model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def local(model_dir):
    return xlm.LLM(
        model=model_dir,
        max_model_len=256,
        max_num_batched_tokens=256,
        token_buckets=[32, 256],
        kv_cache_memory=0.1,
    )


@pytest.fixture(scope="module")
def want(local) -> list[float]:
    return [o.outputs.score for o in local.score(QUERY, DOCS, use_tqdm=False)]


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if status == 400:
        assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_equals_llm_score(score_server, want, local, path):
    r = post(score_server, path, {"model": NAME, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME and body["id"]
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in body["data"])
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    tokenizer = local.get_tokenizer()
    tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCS)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    pairs = post(score_server, path, {"text_1": [QUERY, DOCS[0]], "text_2": DOCS[:2]})
    expected = [local.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score]
    expected.append(local.score(DOCS[0], DOCS[1], use_tqdm=False)[0].outputs.score)
    np.testing.assert_allclose([d["score"] for d in pairs.json()["data"]], expected, atol=1e-5)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_by_the_scores_with_top_n(score_server, want, path):
    documents = [DOCS[0], *({"text": d} for d in DOCS[1:])]
    r = post(score_server, path, {"model": NAME, "query": QUERY, "documents": documents})
    assert r.status_code == 200, r.text
    body = r.json()
    order = list(np.argsort(want)[::-1])
    assert [x["index"] for x in body["results"]] == order
    for result in body["results"]:
        assert abs(result["relevance_score"] - want[result["index"]]) < 1e-5
        assert result["document"] == {"text": DOCS[result["index"]]}
    assert body["model"] == NAME and body["usage"]["total_tokens"] > 0
    top = post(
        score_server,
        path,
        {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False},
    ).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all(x.get("document") is None for x in top["results"])


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_equals_llm_classify(score_server, local, path):
    r = post(score_server, path, {"model": NAME, "input": DOCS[:3]})
    assert r.status_code == 200, r.text
    body = r.json()
    want = local.classify(DOCS[:3], use_tqdm=False)
    assert body["object"] == "list" and len(body["data"]) == 3
    for d, w in zip(body["data"], want, strict=True):
        assert d["num_classes"] == 1 and d["label"] == w.outputs.label == "LABEL_0"
        np.testing.assert_allclose(d["probs"], w.outputs.probs, atol=1e-5)


def test_bad_inputs_get_4xx_in_openai_shape(score_server):
    s = score_server
    rerank = {"query": QUERY, "documents": DOCS}
    assert_openai_error(post(s, "/rerank", {**rerank, "documents": []}), 400, "documents")
    assert_openai_error(post(s, "/v1/rerank", {**rerank, "top_n": -1}), 400, "top_n=-1")
    mismatch = {"text_1": ["w1", "w2"], "text_2": ["w3", "w4", "w5"]}
    assert_openai_error(post(s, "/v1/score", mismatch), 400, "text_1 has 2", "text_2 has 3")
    assert_openai_error(post(s, "/v1/score", {"text_1": "w1", "text_2": []}), 400, "empty")
    long = " ".join(["w5"] * 300)
    assert_openai_error(post(s, "/v1/score", {"text_1": long, "text_2": "w1"}), 400, "301 tokens")
    assert_openai_error(post(s, "/v1/classify", {"input": [long]}), 400, "300 tokens")
    assert_openai_error(post(s, "/v1/score", {"model": "nope", "text_1": "a", "text_2": "b"}), 404)
    embed = post(s, "/v1/embeddings", {"input": "w1"})
    assert_openai_error(embed, 400, "classifier", "not embeddings")
    r = post(s, "/v1/score", {"text_1": "w1", "text_2": "w2"})  # still serving
    assert r.status_code == 200


def test_a_generating_model_refuses_with_a_400(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in (
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/classify", {"input": "a"}),
    ):
        r = post(server, path, body, headers=auth)
        assert_openai_error(r, 400, "generates text", "does not")
    r = post(server, "/v1/score", {"text_1": "a", "text_2": "b"})
    assert r.status_code == 401  # the API key guards the new routes too


def test_schemathesis_fuzz_of_the_scoring_routes_finds_no_server_error(score_server):
    pytest.importorskip("schemathesis")
    want = {"/v1/score", "/v1/rerank", "/v1/classify"}
    paths, failures = fuzz_for_server_errors(score_server.url, paths=want, examples=15)
    assert paths == want
    assert not failures, "\n".join(failures[:10]) + "\n" + score_server.log_tail()
