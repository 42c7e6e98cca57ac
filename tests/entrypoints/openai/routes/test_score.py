"""The scoring routes on the app: every path vLLM serves answers (through the API key),
their bodies are in the OpenAPI document, and a bad body is a 400 in OpenAI's shape."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.openai.test_serving_score import FakePoolingEngine
from xlm.entrypoints.openai.api_server import build_app
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser

KEY = "k"
BODIES = {
    "score": {"text_1": "w1", "text_2": ["w2", "w3 w4"]},
    "rerank": {"query": "w1", "documents": ["w2", "w3 w4"]},
    "classify": {"input": ["w2", "w3 w4"]},
}
PATHS = {
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/classify": "classify",
    "/v1/classify": "classify",
}


@pytest.fixture(scope="module")
def client():
    args = finish_args(make_arg_parser(argparse.ArgumentParser()), ["m", "--api-key", KEY])
    with TestClient(build_app(args, FakePoolingEngine(("LABEL_0",)))) as c:
        yield c


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_answers_behind_the_api_key(client, path):
    body = BODIES[PATHS[path]]
    assert client.post(path, json=body).status_code == 401
    r = client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    result = r.json()
    assert len(result["results"] if "results" in result else result["data"]) == 2


def test_bodies_are_in_the_openapi_document_and_bad_ones_are_400s(client):
    spec = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    for path, kind in PATHS.items():
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert schema["schema"]["title"].lower().startswith(kind[:5])
    r = client.post(
        "/v1/rerank",
        json={"query": "w1", "documents": []},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "documents"


def test_a_draining_server_refuses_every_path_with_503(client):
    client.app.state.xlm.draining = True
    try:
        for path, kind in PATHS.items():
            r = client.post(path, json=BODIES[kind], headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 503, (path, r.text)
    finally:
        client.app.state.xlm.draining = False
