"""HTTP guards of the server: API key, request-body size, and which routes stay open.

`BodySizeLimit` is a pure ASGI middleware: it answers 413 from `Content-Length` before
reading anything, and for a chunked body it stops reading as soon as the received bytes
pass the limit, so a huge body is never held in memory whole.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException

# Routes answered without the API key (load balancers and probes use them).
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})


def api_key_ok(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries the key (compared in constant time)."""
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((header or "").encode(), expected)


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


class BodyTooLargeError(HTTPException):
    """Raised while a route reads a body past the limit (the app answers it as 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large_message(max_bytes))


def _too_large_message(max_bytes: int) -> str:
    return (
        f"The request body is larger than the server's limit of {max_bytes} bytes "
        "(see --max-request-body-bytes)"
    )


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLargeError:
            if not started:
                await self._reject(send)

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
