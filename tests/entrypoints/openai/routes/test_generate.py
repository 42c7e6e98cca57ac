"""The generation routes over the stand-in engine: admission around every request (429 with
Retry-After past it, released after a response, a stream or an error), a dead engine's
error, and the stream's content type; read by the official openai client."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.test_api_server import MODEL, make_client
from xlm.engine.exceptions import EngineDeadError

ROUTES = {
    "/v1/completions": {"prompt": "hello there", "max_tokens": 2, "n": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "n": 2,
    },
}


@pytest.fixture
def http(tokenizer):
    # Room for 3 sequences: one n=2 request fits, a second one does not.
    with make_client(tokenizer, "--max-num-seqs", "2", "--max-waiting-requests", "1") as c:
        yield c


@pytest.mark.parametrize("path", ROUTES)
def test_past_the_admission_limit_is_a_429_with_retry_after(http, path):
    admission = http.app.state.xlm.admission
    assert admission.capacity == 3
    assert admission.try_acquire(2)  # an n=2 request in flight
    r = http.post(path, json=ROUTES[path])
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "too_many_requests")
    assert "2 sequences are running or waiting (limit 3)" in error["message"]
    assert admission.in_flight == 2  # the refused request took nothing
    admission.release(2)
    assert http.post(path, json=ROUTES[path]).status_code == 200
    assert admission.in_flight == 0


@pytest.mark.parametrize("path", ROUTES)
def test_streams_and_errors_give_their_admission_back(http, path):
    admission = http.app.state.xlm.admission
    with http.stream("POST", path, json={**ROUTES[path], "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert admission.in_flight == 2  # held while the stream runs
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and admission.in_flight == 0
    bad = http.post(path, json={**ROUTES[path], "max_tokens": -1})
    assert bad.status_code == 400 and admission.in_flight == 0
    json_type = {"Content-Type": "application/json"}
    assert http.post(path, content=b"{not json", headers=json_type).status_code == 400
    assert admission.in_flight == 0


def test_a_dead_engine_answers_500_engine_dead_without_its_text(tokenizer):
    with make_client(tokenizer) as http:
        engine = http.app.state.xlm.engine
        engine.errored, engine.dead_error = True, EngineDeadError("secret /path in a traceback")
        client = openai.OpenAI(
            api_key="none", base_url="http://testserver/v1", http_client=http, max_retries=0
        )
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 500 and e.value.code == "engine_dead"
        assert "secret" not in e.value.message and "error id err-" in e.value.message
        assert http.app.state.xlm.admission.in_flight == 0
