"""Per-request size caps of the OpenAI server (each a 400 naming the field and the cap).

The caps keep one request from costing more than a bounded amount of front-end work
(tokenizing stop strings and bad words, building logit-bias rows) and keep every integer
within the wire type it travels as (msgpack int64, the device's int32 / uint64), so
nothing overflows after admission. `n` (and `best_of`) is capped by `--max-n`; the body
size by `--max-request-body-bytes`; the rest are fixed here and listed in docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from xlm.engine.exceptions import RequestValidationError
from xlm.sampling_params import MAX_LOGIT_BIAS_TOKENS

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1

# Integer fields as they cross the wire: bounds are part of the schema (pydantic 400s).
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]

DEFAULT_MAX_N = 64
MAX_PROMPTS_PER_REQUEST = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_LOGIT_BIAS = MAX_LOGIT_BIAS_TOKENS
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Default waiting room past max_num_seqs: this many times max_num_seqs.
WAITING_PER_SEQ = 8


@dataclass(frozen=True)
class RequestLimits:
    """The caps a request is checked against before any tokenization."""

    max_n: int = DEFAULT_MAX_N


def _error(message: str, param: str) -> RequestValidationError:
    return RequestValidationError(message, param)


def _too_many(name: str, count: int, cap: int, what: str = "entries") -> RequestValidationError:
    return _error(f"{name} has {count} {what}: at most {cap} are allowed", name)


def _check_len(name: str, value: Any, cap: int, what: str = "entries") -> None:
    if value is not None and not isinstance(value, str) and len(value) > cap:
        raise _too_many(name, len(value), cap, what)


def _check_strings(name: str, values: Any, count_cap: int, chars_cap: int) -> None:
    if values is None:
        return
    items = [values] if isinstance(values, str) else list(values)
    _check_len(name, items, count_cap, "strings")
    for i, item in enumerate(items):
        if isinstance(item, str) and len(item) > chars_cap:
            raise _error(
                f"{name}[{i}] is {len(item)} characters long: at most {chars_cap} are allowed",
                name,
            )


def check_request_limits(request: Any, limits: RequestLimits) -> None:
    """400 (RequestValidationError) for the first field over its cap."""
    for name in ("n", "best_of"):
        value = getattr(request, name, None)
        if value is not None and value > limits.max_n:
            raise _error(
                f"{name}={value} is over the server's limit: at most {limits.max_n} (see --max-n)",
                name,
            )
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        _check_len("prompt", prompt, MAX_PROMPTS_PER_REQUEST, "prompts")
    _check_strings("stop", request.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
    _check_len("stop_token_ids", request.stop_token_ids, MAX_STOP_TOKEN_IDS, "token ids")
    _check_strings("bad_words", request.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
    _check_len("logit_bias", request.logit_bias, MAX_LOGIT_BIAS)
    _check_len("allowed_token_ids", request.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS, "token ids")
