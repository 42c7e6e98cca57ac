"""HTTP guards of the server: API key, request-body size, and which routes stay open.

`BodySizeLimit` is a pure ASGI middleware: it answers 413 from `Content-Length` before
reading anything, and for a chunked body it stops reading as soon as the received bytes
pass the limit, so a huge body is never held in memory.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from xlm.entrypoints.openai.messages_protocol import is_messages_path

# Routes answered without the API key (load balancers and probes use them).
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})


def api_key_ok(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries the key (compared in constant time)."""
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((header or "").encode(), expected)


def request_key_ok(path: str, headers: Any, api_key: str) -> bool:
    """Whether a request carries the key: `Authorization: Bearer` on every route, and
    Anthropic's `x-api-key` header too on the Messages API's routes."""
    if api_key_ok(headers.get("authorization"), api_key):
        return True
    if is_messages_path(path):
        given = (headers.get("x-api-key") or "").encode()
        return hmac.compare_digest(given, api_key.encode())
    return False


def needs_api_key(path: str, method: str, protect_metrics: bool) -> bool:
    """Every route but the probes (and /metrics unless protected); CORS preflights pass."""
    if method == "OPTIONS":
        return False
    if path in OPEN_PATHS:
        return False
    if path == "/metrics":
        return protect_metrics
    return True


def _error_body(message: str, status: int, err_type: str, param: str | None = None) -> bytes:
    error = {"message": message, "type": err_type, "param": param, "code": None}
    return json.dumps({"error": error}).encode()


def _too_large_message(max_bytes: int) -> str:
    return (
        f"The request body is larger than the server's limit of {max_bytes} bytes "
        "(see --max-request-body-bytes)"
    )


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`.

    A declared Content-Length over the limit is refused before any byte is read (the
    HTTP server delivers no more than the declared length). A body without one (chunked)
    is read here, at most `max_bytes + 1` bytes of it, then replayed to the app.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        if declared is not None:
            if declared > self.max_bytes:
                await self._reject(send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected: nothing to answer
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Any) -> None:
        body = _error_body(_too_large_message(self.max_bytes), 413, "invalid_request_error")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
