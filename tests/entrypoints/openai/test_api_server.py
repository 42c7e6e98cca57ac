"""Issue 14 over a stand-in engine: request caps, body limit, API key, CORS, 500s, models.

The real engine is exercised by tests/e2e/test_server_hardening.py (overload, fuzz).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.entrypoints.openai.api_server import build_app
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser

MODEL = "/home/someone/private/models/secret-model"
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make_client(tokenizer, *flags: str, engine=None) -> TestClient:
    args = finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL, *flags])
    engine = engine or FakeAsyncEngine(tokenizer, max_model_len=64)
    return TestClient(build_app(args, engine))


@pytest.fixture(scope="module")
def client(tokenizer):
    with make_client(tokenizer, "--api-key", KEY, "--max-n", "4") as c:
        c.headers.update(AUTH)
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "body, param, cap",
    [
        ({"prompt": "x", "n": 5}, "n", "4"),
        ({"prompt": "x", "n": 4, "best_of": 5}, "best_of", "4"),
        ({"prompt": ["a"] * 65}, "prompt", "64"),
        ({"prompt": [[1, 2]] * 65}, "prompt", "64"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop", "16"),
        ({"prompt": "x", "stop": "s" * 257}, "stop", "256"),
        ({"prompt": "x", "bad_words": ["w"] * 129}, "bad_words", "128"),
        ({"prompt": "x", "bad_words": ["w" * 300]}, "bad_words", "256"),
        ({"prompt": "x", "stop_token_ids": [1] * 257}, "stop_token_ids", "256"),
        ({"prompt": "x", "allowed_token_ids": [1] * 65537}, "allowed_token_ids", "65536"),
        ({"prompt": "x", "seed": 2**64}, "seed", "18446744073709551615"),
        ({"prompt": "x", "top_k": 2**40}, "top_k", "2147483647"),
        ({"prompt": "x", "priority": -(2**40)}, "priority", "-2147483648"),
        ({"prompt": "x", "min_tokens": 2**31}, "min_tokens", "2147483647"),
        ({"prompt": [2**63]}, "prompt", "9223372036854775807"),
    ],
)
def test_caps_are_400s_naming_field_and_cap(client, body, param, cap):
    error = _error(client.post("/v1/completions", json={"max_tokens": 2, **body}), 400)
    assert error["param"] == param, error
    assert cap in error["message"], error


def test_chat_caps_and_requests_under_the_caps_run(client):
    messages = [{"role": "user", "content": "hi"}]
    error = _error(client.post("/v1/chat/completions", json={"messages": messages, "n": 9}), 400)
    assert error["param"] == "n"
    ok = client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 4, "stop": ["s"] * 16, "max_tokens": 2}
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


def test_body_over_the_limit_is_413_before_it_is_read(tokenizer):
    with make_client(tokenizer, "--max-request-body-bytes", "1000") as c:
        small = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert small.status_code == 200
        big = {"prompt": "x" * 2000, "max_tokens": 2}
        error = _error(c.post("/v1/completions", json=big), 413)
        assert "1000 bytes" in error["message"]

        def chunks():  # no Content-Length: cut while streaming in
            for _ in range(10):
                yield b" " * 500
            yield b'{"prompt": "x"}'

        r = c.post(
            "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        _error(r, 413)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_api_key_guards_every_route_but_the_probes(tokenizer):
    with make_client(tokenizer, "--api-key", KEY) as c:
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert c.get(path).status_code == 200, path
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "x"}),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/openapi.json", None),
            ("GET", "/docs", None),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = c.request(method, path, json=body, headers=headers)
                assert _error(r, 401)["code"] == "invalid_api_key", (path, headers)
            assert c.request(method, path, json=body, headers=AUTH).status_code == 200, path
    with make_client(tokenizer, "--api-key", KEY, "--metrics-require-api-key") as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=AUTH).status_code == 200
        assert c.get("/health").status_code == 200


def test_cors_defaults_and_credentials(tokenizer):
    preflight = {
        "Origin": "https://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    with make_client(tokenizer) as c:  # default: no CORS at all
        r = c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    with make_client(tokenizer, "--allowed-origins", "*") as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers
    with make_client(
        tokenizer, "--allowed-origins", "https://app.example", "--allow-credentials"
    ) as c:
        r = c.options("/v1/completions", headers=dict(preflight, Origin="https://app.example"))
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        r = c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    with pytest.raises(SystemExit):
        finish_args(
            make_arg_parser(argparse.ArgumentParser()),
            [MODEL, "--allowed-origins", "*", "--allow-credentials"],
        )


class _BrokenEngine(FakeAsyncEngine):
    async def generate(self, *args, **kwargs):
        raise RuntimeError("boom at /opt/xlm/secret/internal.py line 12")
        yield  # pragma: no cover


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_500_carries_an_error_id_not_the_exception_text(tokenizer):
    engine = _BrokenEngine(tokenizer, max_model_len=64)
    records = _Records()
    log = logging.getLogger("xlm.entrypoints.openai.serving_engine")
    log.addHandler(records)
    try:
        with make_client(tokenizer, engine=engine) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            error = _error(r, 500)
    finally:
        log.removeHandler(records)
    assert "/opt/xlm" not in error["message"] and "boom" not in error["message"]
    error_id = error["message"].split("error id ", 1)[1].split(";", 1)[0]
    assert error_id.startswith("err-")
    logged = [r for r in records.records if error_id in r.getMessage()]
    assert logged and "boom at /opt/xlm" in str(logged[0].exc_info[1])  # logged, by id


def test_request_chat_template_only_when_trusted(tokenizer):
    template = (
        "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}!{% endif %}"
    )
    body = {
        "messages": [{"role": "user", "content": " world"}],
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "Hello"},
        "max_tokens": 3,
    }
    with make_client(tokenizer) as c:
        error = _error(c.post("/v1/chat/completions", json=body), 400)
        assert (
            error["param"] == "chat_template"
            and "--trust-request-chat-template" in (error["message"])
        )
    with make_client(tokenizer, "--trust-request-chat-template") as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        # The stand-in engine echoes the prompt: the kwarg reached the template.
        expected = tokenizer.encode("Hello world!", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(expected)
        bad = dict(body, chat_template_kwargs={"tokenize": False})
        assert _error(c.post("/v1/chat/completions", json=bad), 400)["param"] == "messages"


class _ThreadRecordingTokenizer:
    """The real tokenizer, noting which thread each encode / template render ran on."""

    def __init__(self, inner):
        self._inner = inner
        self.threads: list[str] = []

    def encode(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self._inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self):
        return len(self._inner)


def test_tokenization_and_templates_run_off_the_event_loop(tokenizer):
    recording = _ThreadRecordingTokenizer(tokenizer)
    engine = FakeAsyncEngine(recording, max_model_len=64)
    loop_threads: list[str] = []

    async def main() -> None:
        loop_threads.append(threading.current_thread().name)
        args = finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL])
        transport = httpx.ASGITransport(app=build_app(args, engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
            assert r.status_code == 200
            msgs = [{"role": "user", "content": "hi"}]
            r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
            assert r.status_code == 200
            r = await c.post("/tokenize", json={"prompt": "hello"})
            assert r.status_code == 200

    asyncio.run(main())
    assert len(recording.threads) >= 3
    assert loop_threads[0] not in recording.threads, recording.threads


def test_max_logprobs_is_capped_at_what_the_device_returns(capsys):
    from xlm.sampling_params import MAX_DEVICE_LOGPROBS

    parser = make_arg_parser(argparse.ArgumentParser())
    assert finish_args(parser, [MODEL, "--max-logprobs", str(MAX_DEVICE_LOGPROBS)])
    with pytest.raises(SystemExit):
        finish_args(parser, [MODEL, "--max-logprobs", str(MAX_DEVICE_LOGPROBS + 1)])
    assert f"allowed [0, {MAX_DEVICE_LOGPROBS}]" in capsys.readouterr().err
