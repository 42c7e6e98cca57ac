"""Errors the engine front end raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process died or failed; no further request can be served."""

    def __init__(self, message: str = "the engine core process is dead", *args: object) -> None:
        super().__init__(message, *args)


class EngineGenerateError(RuntimeError):
    """One request failed inside the engine; the engine itself is still healthy."""


class RequestAbortedError(EngineGenerateError):
    """The server aborted the request (shutdown); callers finish it with reason "abort"."""
