"""`xlm run-batch` with `"url": "/v1/responses"` lines: answered by the server's handler,
the same text as a chat line over the same conversation, errors per line."""

from __future__ import annotations

import pytest
from openai.types.responses import Response

from tests.e2e.test_run_batch_jobs import read, run_batch

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


def _records() -> list[dict]:
    def line(custom_id, url, body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    return [
        line(
            "resp",
            "/v1/responses",
            {
                "instructions": "Be brief.",
                "input": [{"role": "user", "content": "hello"}],
                "max_output_tokens": 5,
                "temperature": 0,
            },
        ),
        line(
            "chat",
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 5, "temperature": 0},
        ),
        line("bad", "/v1/responses", {"input": [{"type": "web_search_call"}]}),
    ]


def test_responses_lines_equal_chat_lines(batch_job):
    model, tmp, infile, env = batch_job("batch-responses", _records())
    outfile = tmp / "out.jsonl"
    run_batch(model, infile, outfile, env, rc=1)  # the bad line failed: exit 1
    resp, chat, bad = read(outfile)
    assert resp["response"]["status_code"] == 200, resp
    response = Response.model_validate(resp["response"]["body"])
    assert resp["response"]["request_id"] == response.id and response.id.startswith("resp_")
    message = chat["response"]["body"]["choices"][0]["message"]
    assert response.output_text == message["content"]
    usage = chat["response"]["body"]["usage"]
    assert response.usage.input_tokens == usage["prompt_tokens"]
    assert response.usage.output_tokens == usage["completion_tokens"]
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "input"
