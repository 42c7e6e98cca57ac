"""Per-request caps: each field one past its cap is refused naming the field and the cap,
at the cap it passes; the wire integer types bound their values (the server's 400s for
them: tests/e2e/test_server_hardening.py)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from xlm.engine.exceptions import RequestValidationError
from xlm.entrypoints.openai import limits
from xlm.entrypoints.openai.limits import RequestLimits, check_request_limits
from xlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt=fields.pop("prompt", "hi"), **fields)


CASES = [
    ("stop", lambda k: ["s"] * k, limits.MAX_STOP_STRINGS, "stop has 17 strings: at most 16"),
    (
        "stop",
        lambda k: "x" * k,
        limits.MAX_STOP_STRING_CHARS,
        "stop\\[0\\] is 257 characters long: at most 256",
    ),
    (
        "stop_token_ids",
        lambda k: list(range(k)),
        limits.MAX_STOP_TOKEN_IDS,
        "stop_token_ids has 257 token ids: at most 256",
    ),
    ("bad_words", lambda k: ["w"] * k, limits.MAX_BAD_WORDS, "bad_words has 129 strings"),
    (
        "bad_words",
        lambda k: ["ok", "w" * k],
        limits.MAX_BAD_WORD_CHARS,
        "bad_words\\[1\\] is 257 characters long",
    ),
    (
        "logit_bias",
        lambda k: {str(i): 1.0 for i in range(k)},
        limits.MAX_LOGIT_BIAS,
        f"logit_bias has {limits.MAX_LOGIT_BIAS + 1} entries",
    ),
    (
        "allowed_token_ids",
        lambda k: list(range(k)),
        limits.MAX_ALLOWED_TOKEN_IDS,
        "allowed_token_ids has 65537 token ids",
    ),
    ("prompt", lambda k: ["p"] * k, limits.MAX_PROMPTS_PER_REQUEST, "prompt has 65 prompts"),
]


@pytest.mark.parametrize("field, make, cap, message", CASES)
def test_each_cap_admits_its_limit_and_refuses_one_more(field, make, cap, message):
    check_request_limits(_completion(**{field: make(cap)}), RequestLimits())
    with pytest.raises(RequestValidationError, match=message) as e:
        check_request_limits(_completion(**{field: make(cap + 1)}), RequestLimits())
    assert e.value.param == field


def test_n_is_capped_by_the_servers_max_n():
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=5)
    check_request_limits(chat, RequestLimits(max_n=5))
    with pytest.raises(RequestValidationError, match=r"n=5 is over .* at most 4 \(see --max-n\)"):
        check_request_limits(chat, RequestLimits(max_n=4))
    best = _completion(n=1, best_of=3)
    with pytest.raises(RequestValidationError, match="best_of=3") as e:
        check_request_limits(best, RequestLimits(max_n=2))
    assert e.value.param == "best_of"
    # A prompt of token ids is one prompt, however long.
    check_request_limits(_completion(prompt=list(range(1000))), RequestLimits())


@pytest.mark.parametrize(
    "kind, low, high",
    [
        (limits.Int32, -(2**31), 2**31 - 1),
        (limits.Int64, -(2**63), 2**63 - 1),
        (limits.Seed, -(2**63), 2**64 - 1),
    ],
)
def test_wire_integers_are_bounded(kind, low, high):
    adapter = TypeAdapter(kind)
    assert adapter.validate_python(low) == low and adapter.validate_python(high) == high
    for outside in (low - 1, high + 1):
        with pytest.raises(ValidationError):
            adapter.validate_python(outside)
