"""Errors the engine front end raises to its callers."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request that asks for something invalid: a 400 naming the parameter.

    Raised by the one place each rule lives (SamplingParams for a parameter alone, the
    Processor for a parameter against the model, the server's protocol for HTTP fields);
    `param` names the field, `code` is OpenAI's error code where it has one.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    @classmethod
    def from_value_error(cls, error: ValueError) -> RequestValidationError:
        """A SamplingParams error, with the parameter its message names."""
        if isinstance(error, RequestValidationError):
            return error
        return cls(str(error), param_of(str(error)))


def param_of(message: str) -> str | None:
    """The parameter a SamplingParams or PoolingParams error names
    ("SamplingParams.top_p=... is invalid" -> "top_p")."""
    for prefix in ("SamplingParams.", "PoolingParams."):
        if message.startswith(prefix):
            rest = message[len(prefix) :]
            for sep in ("=", " ", "["):
                rest = rest.split(sep, 1)[0]
            return rest
    return None


class EngineDeadError(RuntimeError):
    """The engine-core process died or failed; no further request can be served."""

    def __init__(self, message: str = "the engine core process is dead", *args: object) -> None:
        super().__init__(message, *args)


class EngineGenerateError(RuntimeError):
    """One request failed inside the engine; the engine itself is still healthy."""


class RequestAbortedError(EngineGenerateError):
    """The server aborted the request (shutdown); callers finish it with reason "abort"."""


class EngineBusyError(ValueError):
    """A call that needs an idle engine (sleep, update_weights) while requests run."""
