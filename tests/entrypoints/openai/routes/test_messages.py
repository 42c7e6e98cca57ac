"""The Messages routes on the app: both paths registered for POST, `MessagesErrorShape`
giving every layer's error Anthropic's shape on these paths only (driven directly as an
ASGI middleware, and on the app), and x-api-key accepted there only.

The handler behind the routes is tested in tests/entrypoints/openai/test_serving_messages.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from tests.entrypoints.openai.test_serving_messages import _anthropic_error
from xlm.entrypoints.openai.api_server import build_app
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser
from xlm.entrypoints.openai.routes import messages

KEY = "sekrit"
BEARER = {"Authorization": f"Bearer {KEY}"}
MODEL = "m"


def _args(*flags: str) -> argparse.Namespace:
    return finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL, *flags])


@pytest.fixture(scope="module")
def http(tokenizer):
    with TestClient(build_app(_args("--api-key", KEY), FakeAsyncEngine(tokenizer, 128))) as c:
        yield c


def _ask(**kwargs):
    body = {"model": MODEL, "max_tokens": 4, "system": "s"}
    body["messages"] = [{"role": "user", "content": "x y"}]
    return {**body, **kwargs}


def _methods(routes) -> dict[str, set[str]]:
    return {r.path: set(r.methods) for r in routes if isinstance(r, APIRoute)}


def test_both_routes_are_registered_for_post(http):
    expected = {"/v1/messages": {"POST"}, "/v1/messages/count_tokens": {"POST"}}
    assert _methods(messages.router.routes) == expected
    spec = http.get("/openapi.json", headers=BEARER).json()
    titles = {"/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "CountTokensRequest"}
    for path, title in titles.items():
        assert set(spec["paths"][path]) == {"post"}
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["title"] == title
        _anthropic_error(http.put(path, json=_ask(), headers=BEARER), 405, "invalid_request_error")


# ---- MessagesErrorShape as an ASGI middleware ---------------------------------------------------


def _drive(path: str, status: int, chunks: list[bytes], scope_type: str = "http") -> list[dict]:
    """What the middleware sends for an app answering `status` with `chunks` at `path`."""

    async def app(scope, receive, send):
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"999")]
        await send({"type": "http.response.start", "status": status, "headers": headers + EXTRA})
        for i, chunk in enumerate(chunks):
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1}
            )

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    scope = {"type": scope_type, "path": path}
    asyncio.run(messages.MessagesErrorShape(app)(scope, receive, send))
    return sent


EXTRA = [(b"retry-after", b"1")]
OPENAI_ERROR = json.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})


def test_an_error_in_chunks_is_rejoined_and_reshaped_with_its_headers():
    body = OPENAI_ERROR.encode()
    sent = _drive("/v1/messages", 429, [body[:10], body[10:25], body[25:]])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    start, end = sent
    assert start["status"] == 429 and not end.get("more_body", False)
    expected = {"type": "error", "error": {"type": "overloaded_error", "message": "slow down"}}
    assert json.loads(end["body"]) == expected
    headers = dict(start["headers"])
    assert headers == {
        b"retry-after": b"1",
        b"content-type": b"application/json",
        b"content-length": str(len(end["body"])).encode(),
    }
    assert len(start["headers"]) == 3  # the app's content-type and length are replaced


@pytest.mark.parametrize(
    ("path", "status"),
    [("/v1/chat/completions", 429), ("/v1/messagesX", 400), ("/v1/messages", 200)],
)
def test_other_paths_and_successes_pass_untouched(path, status):
    chunks = [b"data: 1\n\n", b"data: 2\n\n"]
    sent = _drive(path, status, chunks)
    assert len(sent) == 3 and sent[0]["status"] == status
    assert sent[0]["headers"][-1] == EXTRA[0] and sent[0]["headers"][0][1] == b"text/plain"
    assert [m["body"] for m in sent[1:]] == chunks and sent[1]["more_body"]


def test_an_empty_error_body_stays_empty_and_other_scopes_pass():
    start, end = _drive("/v1/messages/count_tokens", 401, [b""])
    assert start["status"] == 401 and end["body"] == b""
    assert dict(start["headers"])[b"content-length"] == b"0"
    sent = _drive("/v1/messages", 500, [b"boom"], scope_type="websocket")
    assert [m.get("body") for m in sent[1:]] == [b"boom"]


# ---- on the app: every layer's error, x-api-key ------------------------------------------------


def test_errors_of_other_layers_take_anthropic_shape_here_only(tokenizer, http):
    _anthropic_error(http.get("/v1/messages", headers=BEARER), 405, "invalid_request_error")
    r = http.post("/v1/messages", content=b"{", headers={**BEARER, "content-type": "text/plain"})
    _anthropic_error(r, 415, "invalid_request_error")
    _anthropic_error(http.post("/v1/messages", json=_ask()), 401, "authentication_error")
    r = http.post("/v1/messages/count_tokens", json={"model": MODEL}, headers=BEARER)
    _anthropic_error(r, 400, "invalid_request_error")
    args = _args("--max-request-body-bytes", "64")
    with TestClient(build_app(args, FakeAsyncEngine(tokenizer, 128))) as small:
        r = small.post("/v1/messages", json=_ask(system="s" * 100))
        _anthropic_error(r, 413, "request_too_large")
    chat = http.post("/v1/chat/completions", json={"messages": []}, headers={"x-api-key": KEY})
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"


def test_x_api_key_and_bearer_both_open_the_messages_routes(http):
    for headers in ({"x-api-key": KEY}, BEARER):
        assert http.post("/v1/messages", json=_ask(), headers=headers).status_code == 200
        ask = {k: v for k, v in _ask().items() if k != "max_tokens"}
        r = http.post("/v1/messages/count_tokens", json=ask, headers=headers)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 401
    wrong = http.post("/v1/messages", json=_ask(), headers={"x-api-key": "wrong"})
    _anthropic_error(wrong, 401, "authentication_error")


def test_overload_and_draining_are_overloaded_errors_keeping_their_status(tokenizer):
    args = _args("--max-num-seqs", "1", "--max-waiting-requests", "0")
    app = build_app(args, FakeAsyncEngine(tokenizer, 128))
    with TestClient(app) as c:
        state = app.state.xlm
        assert state.admission.try_acquire(1)  # the one seat is taken
        r = c.post("/v1/messages", json=_ask())
        assert "retry" in _anthropic_error(r, 429, "overloaded_error")
        assert r.headers["retry-after"] == "1"
        state.admission.release(1)
        assert c.post("/v1/messages", json=_ask()).status_code == 200
        state.draining = True
        _anthropic_error(c.post("/v1/messages", json=_ask()), 503, "overloaded_error")
        other = c.post("/v1/completions", json={"prompt": "x"}).json()
        assert set(other) == {"error"} and other["error"]["type"] == "service_unavailable"
