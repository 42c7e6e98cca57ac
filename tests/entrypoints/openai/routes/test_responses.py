"""The Responses routes on the app, over a stand-in engine and through the official openai
client: POST /v1/responses and GET / DELETE /v1/responses/{id} are registered behind the
API key, answer what the handler holds, and 404 an unknown id in OpenAI's shape.

The handler's own logic is tested in tests/entrypoints/openai/test_serving_responses.py.
"""

from __future__ import annotations

import argparse
import json

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.entrypoints.openai.api_server import build_app
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser
from xlm.entrypoints.openai.routes import responses

openai = pytest.importorskip("openai")

KEY = "sekrit"
BEARER = {"Authorization": f"Bearer {KEY}"}
MODEL = "m"


@pytest.fixture(scope="module")
def http(tokenizer):
    args = finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL, "--api-key", KEY])
    with TestClient(build_app(args, FakeAsyncEngine(tokenizer, 128))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
    )


def _not_found(r, response_id: str, param: str | None = None) -> None:
    assert r.status_code == 404, r.text
    assert r.json() == {
        "error": {
            "message": f"Response with id '{response_id}' not found.",
            "type": "invalid_request_error",
            "param": param,
            "code": "response_not_found",
        }
    }


def test_the_routes_are_registered_with_their_methods(http):
    methods: dict[str, set[str]] = {}
    for route in responses.router.routes:
        if isinstance(route, APIRoute):
            methods.setdefault(route.path, set()).update(route.methods)
    assert methods == {
        "/v1/responses": {"POST"},
        "/v1/responses/{response_id}": {"GET", "DELETE"},
    }
    spec = http.get("/openapi.json", headers=BEARER).json()["paths"]
    assert set(spec["/v1/responses"]) == {"post"}
    assert set(spec["/v1/responses/{response_id}"]) == {"get", "delete"}
    body = spec["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["title"] == "ResponsesRequest"
    for method, path in (("GET", "/v1/responses"), ("PUT", "/v1/responses/resp_x")):
        assert http.request(method, path, headers=BEARER).status_code == 405


def test_every_route_is_behind_the_api_key(http):
    for method, path in (
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
    ):
        r = http.request(method, path, json={"input": "x"}, headers={"x-api-key": KEY})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_create_get_and_delete_answer_what_the_handler_holds(http, client):
    created = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert created.id.startswith("resp_") and created.output_text
    assert created.status == "incomplete"  # the stand-in engine runs to max_output_tokens
    handler = http.app.state.xlm.responses
    got = http.get(f"/v1/responses/{created.id}", headers=BEARER)
    assert got.status_code == 200 and got.json() == handler.retrieve(created.id)
    assert client.responses.retrieve(created.id).output_text == created.output_text
    r = http.delete(f"/v1/responses/{created.id}", headers=BEARER)
    assert r.status_code == 200
    assert r.json() == {"id": created.id, "object": "response", "deleted": True}
    assert len(handler.store) == 0
    _not_found(http.get(f"/v1/responses/{created.id}", headers=BEARER), created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_unknown_ids_are_404s_in_openai_shape(http):
    _not_found(http.get("/v1/responses/resp_nope", headers=BEARER), "resp_nope")
    _not_found(http.delete("/v1/responses/resp_nope", headers=BEARER), "resp_nope")
    body = {"input": "x", "previous_response_id": "resp_nope"}
    r = http.post("/v1/responses", json=body, headers=BEARER)
    _not_found(r, "resp_nope", "previous_response_id")


def test_a_streamed_response_is_sse_and_then_got_by_its_id(http):
    body = {"input": "hi", "max_output_tokens": 4, "stream": True}
    r = http.post("/v1/responses", json=body, headers=BEARER)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in r.text.strip().split("\n\n")]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.incomplete"
    last = events[-1]["response"]
    got = http.get(f"/v1/responses/{last['id']}", headers=BEARER)
    assert got.status_code == 200 and got.json() == last
