"""A real `xlm serve` (tiny model) under overload and under schemathesis fuzzing.

One server for the module: max-num-seqs 2 and a waiting room of 6 sequences, so 400
requests at once mostly get 429; the fuzz run then goes over every operation of the
server's own OpenAPI schema, and a normal request must still be answered afterwards.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.server_utils import RemoteServer, fuzz_for_server_errors, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny"
MAX_NUM_SEQS = 2
MAX_WAITING = 6
NUM_REQUESTS = 400
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = RemoteServer(
        [
            "--api-key",
            KEY,
            "--served-model-name",
            NAME,
            "--max-model-len",
            "128",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-waiting-requests",
            str(MAX_WAITING),
            "--max-num-batched-tokens",
            "64",
            "--kv-cache-memory",
            "0.02",
            "--max-logprobs",
            "5",
        ],
        model=tiny_checkpoint("llama"),
    )
    yield srv
    srv.stop()


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _wait_idle(server, timeout: float = 60.0) -> str:
    """Poll /metrics until nothing runs, waits or holds KV blocks (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(server)
        values = [
            metric_value(text, name)
            for name in (
                "xlm:num_requests_running",
                "xlm:num_requests_waiting",
                "xlm:kv_cache_usage_perc",
            )
        ]
        if values == [0.0, 0.0, 0.0] or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def _normal_request(server) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_overload_answers_or_429s_every_request_and_settles(server):
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {
            "model": NAME,
            "prompt": f"request {i}",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        return await client.post("/v1/completions", json=body)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=300, limits=limits
        ) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS))), 600
            )

    rejected_before = metric_value(_metrics(server), "xlm:num_requests_rejected_total") or 0.0
    responses = asyncio.run(burst())
    assert len(responses) == NUM_REQUESTS  # none lost, none hung (bounded by wait_for)
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == NUM_REQUESTS, {r.status_code for r in responses}
    assert len(ok) >= MAX_NUM_SEQS + MAX_WAITING and refused
    for r in ok:  # complete answers
        body = r.json()
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["finish_reason"] == "length"
    for r in refused:
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and "retry" in error["message"]
    text = _wait_idle(server)
    assert metric_value(text, "xlm:num_requests_running") == 0
    assert metric_value(text, "xlm:num_requests_waiting") == 0
    assert metric_value(text, "xlm:kv_cache_usage_perc") == 0
    rejected = metric_value(text, "xlm:num_requests_rejected_total") - rejected_before
    assert rejected == len(refused)
    _normal_request(server)


def test_schemathesis_fuzz_finds_no_server_error(server):
    pytest.importorskip("schemathesis")
    paths, failures = fuzz_for_server_errors(server.url, AUTH)
    assert paths >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/responses",
        "/v1/responses/{response_id}",
    }
    assert not failures, "\n".join(failures[:10]) + "\n" + server.log_tail()
    _wait_idle(server)
    _normal_request(server)


def test_usage_reports_prefix_cache_hits(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = [11 + (i % 50) for i in range(60)]  # token ids: 3 whole blocks of 16 and more
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    messages = [{"role": "user", "content": "word " * 60}]
    client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 16
