"""The server's HTTP guards on their own: the API key check, the open routes, and the
request-body limit for declared and chunked bodies (an ASGI app driven directly)."""

from __future__ import annotations

import asyncio
import json

import pytest

from xlm.entrypoints.openai.security import BodySizeLimit, api_key_ok, needs_api_key


def test_api_key_needs_the_bearer_form_of_the_exact_key():
    assert api_key_ok("Bearer k1", "k1")
    assert not api_key_ok("k1", "k1")
    assert not api_key_ok("Bearer k12", "k1")
    assert not api_key_ok(None, "k1")


@pytest.mark.parametrize(
    ("path", "method", "protect_metrics", "needed"),
    [
        ("/v1/completions", "POST", False, True),
        ("/v1/completions", "OPTIONS", False, False),  # CORS preflight
        ("/health", "GET", True, False),
        ("/version", "GET", True, False),
        ("/metrics", "GET", False, False),
        ("/metrics", "GET", True, True),
    ],
)
def test_which_routes_need_the_key(path, method, protect_metrics, needed):
    assert needs_api_key(path, method, protect_metrics) is needed


async def echo_app(scope, receive, send):
    """Answers 200 with the body it read."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def call(chunks: list[bytes], declared: int | None, max_bytes: int = 10) -> tuple[int, bytes]:
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "headers": headers}
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(BodySizeLimit(echo_app, max_bytes)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_declared_length_over_the_limit_is_refused_unread():
    status, body = call([b"x" * 11], declared=11)
    assert status == 413
    error = json.loads(body)["error"]
    assert "limit of 10 bytes" in error["message"] and error["type"] == "invalid_request_error"
    assert call([b"x" * 10], declared=10) == (200, b"x" * 10)


def test_chunked_body_is_cut_off_past_the_limit_and_replayed_below_it():
    assert call([b"abcd", b"efgh", b"ij"], declared=None) == (200, b"abcdefghij")
    status, _ = call([b"abcd", b"efgh", b"ijk"], declared=None)
    assert status == 413
