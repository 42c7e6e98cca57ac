"""The OpenAI server end to end: a real `xlm serve` process, the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAMES
from tests.e2e.server_utils import metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = SERVED_NAMES[0]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_health_models_version_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == SERVED_NAMES
    assert models["data"][0]["max_model_len"] == 256
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "xlm:num_requests_running",
        "xlm:kv_cache_usage_perc",
        "xlm:time_to_first_token_seconds_bucket",
        "xlm:generation_tokens_total",
    ):
        assert name in text


def test_completion_usage_is_exact(client, tokenizer):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == MODEL and out.created > 0
    prompt_ids = tokenizer.encode(PROMPT)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    # The served alias answers too.
    alias = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert alias.choices[0].text == out.choices[0].text


def test_stream_equals_non_stream_at_temperature_zero(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_stream_equals_non_stream(client, tokenizer):
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    from xlm.tokenizer import apply_chat_template

    assert full.usage.prompt_tokens == len(apply_chat_template(tokenizer, MESSAGES))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_and_seeds(client):
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # the n samples differ
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    assert first.usage.completion_tokens == 3 * 8
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, n=2, temperature=0.8, seed=7, stream=True
    )
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values())


def test_logprobs_shapes(client):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and 3 <= len(top) <= 4
        assert token_lp == pytest.approx(max(top.values()), abs=1e-4)  # greedy = argmax
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_stop_strings(client):
    base = (
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    words = [w for w in base.split() if len(w) > 3]
    assert words, base
    stop = words[len(words) // 2]
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert choice.text == base[: base.index(stop)]
    assert choice.model_extra.get("stop_reason") == stop
    kept = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == base[: base.index(stop) + len(stop)]


def test_echo_token_prompts_and_tokenize(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(
        model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0, echo=True
    )
    assert len(out.choices) == 2 and out.choices[0].text.startswith(PROMPT)
    assert out.choices[0].text == out.choices[1].text
    assert out.usage.prompt_tokens == 2 * len(ids)
    scored = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    url = server_url(client)
    tok = httpx.post(url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert tok["tokens"] == ids and tok["count"] == len(ids)
    detok = httpx.post(url + "/detokenize", json={"tokens": ids}, headers=AUTH).json()
    assert detok["prompt"] == PROMPT


def server_url(client) -> str:
    return str(client.base_url).rstrip("/").removesuffix("/v1")


def test_completion_without_max_tokens_near_the_limit_is_capped(client):
    out = client.completions.create(
        model=MODEL, prompt=[100] * 250, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 6  # max-model-len 256 - 250, under the default 16
    assert out.choices[0].finish_reason == "length"


def test_chat_template_options(client):
    cont = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        messages=[*MESSAGES, {"role": "assistant", "content": "Red, green"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert cont.choices[0].message.content is not None
    parts = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}],
    )
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, messages=MESSAGES
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


LONG_IDS = [100] * 256
BAD_INPUTS = [
    # (id, path, json body or raw bytes, headers override, expected status)
    ("temperature<0", "/v1/completions", {"prompt": "x", "temperature": -1}, None, 400),
    ("top_p>1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400),
    ("top_p=0", "/v1/completions", {"prompt": "x", "top_p": 0}, None, 400),
    ("top_k<-1", "/v1/completions", {"prompt": "x", "top_k": -5}, None, 400),
    ("min_p>1", "/v1/completions", {"prompt": "x", "min_p": 2}, None, 400),
    ("n=0", "/v1/completions", {"prompt": "x", "n": 0}, None, 400),
    ("presence>2", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, None, 400),
    ("frequency<-2", "/v1/completions", {"prompt": "x", "frequency_penalty": -3}, None, 400),
    ("repetition=0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, None, 400),
    ("logprobs>max", "/v1/completions", {"prompt": "x", "logprobs": 6}, None, 400),
    ("max_tokens=0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400),
    ("max_tokens<0", "/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400),
    (
        "min>max_tokens",
        "/v1/completions",
        {"prompt": "x", "min_tokens": 9, "max_tokens": 2},
        None,
        400,
    ),
    (
        "stream_options w/o stream",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        None,
        400,
    ),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400),
    ("empty token list", "/v1/completions", {"prompt": []}, None, 400),
    ("token out of vocab", "/v1/completions", {"prompt": [1, 10_000_000]}, None, 400),
    ("negative token", "/v1/completions", {"prompt": [-1, 5]}, None, 400),
    (
        "logit_bias key out of vocab",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"10000000": 1}},
        None,
        400,
    ),
    (
        "logit_bias key not int",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"a": 1}},
        None,
        400,
    ),
    (
        "stop_token_ids out of vocab",
        "/v1/completions",
        {"prompt": "x", "stop_token_ids": [10_000_000]},
        None,
        400,
    ),
    ("prompt at max_model_len", "/v1/completions", {"prompt": LONG_IDS}, None, 400),
    ("prompt over max_model_len", "/v1/completions", {"prompt": LONG_IDS + [100] * 44}, None, 400),
    (
        "max_tokens over context",
        "/v1/completions",
        {"prompt": [100] * 10, "max_tokens": 250},
        None,
        400,
    ),
    (
        "temperature not a number",
        "/v1/completions",
        {"prompt": "x", "temperature": "hot"},
        None,
        400,
    ),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, None, 400),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400),
    ("best_of != n", "/v1/completions", {"prompt": "x", "best_of": 3}, None, 400),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, None, 404),
    (
        "wrong content type",
        "/v1/completions",
        b'{"prompt": "x"}',
        {"Content-Type": "text/plain"},
        415,
    ),
    ("array body", "/v1/completions", b"[1, 2, 3]", None, 400),
    ("string body", "/v1/completions", b'"hello"', None, 400),
    ("malformed json", "/v1/completions", b'{"prompt": ', None, 400),
    ("bad api key", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer nope"}, 401),
    ("missing api key", "/v1/models", None, {"Authorization": ""}, 401),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, None, 400),
    (
        "chat bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "bot", "content": "x"}]},
        None,
        400,
    ),
    ("chat messages not list", "/v1/chat/completions", {"messages": "hi"}, None, 400),
    (
        "chat top_logprobs w/o logprobs",
        "/v1/chat/completions",
        {"messages": MESSAGES, "top_logprobs": 2},
        None,
        400,
    ),
    (
        "chat top_logprobs>max",
        "/v1/chat/completions",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 6},
        None,
        400,
    ),
    (
        "chat max_completion_tokens over context",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 1000},
        None,
        400,
    ),
    (
        "chat image part",
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        None,
        400,
    ),
    (
        "chat both template flags",
        "/v1/chat/completions",
        {"messages": MESSAGES, "continue_final_message": True},
        None,
        400,
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"messages": MESSAGES, "model": "nope"},
        None,
        404,
    ),
    ("tokenize neither", "/tokenize", {"add_special_tokens": True}, None, 400),
    ("detokenize negative", "/detokenize", {"tokens": [-1]}, None, 400),
    ("unknown route", "/v1/embeddings-nope", {"input": "x"}, None, 404),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_are_answered_in_openai_shape(server, case):
    _, path, body, headers, status = case
    all_headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    all_headers = {k: v for k, v in all_headers.items() if v}
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body} if path.startswith("/v1/") else body).encode()
    method = "GET" if body is None else "POST"
    r = httpx.request(method, server.url + path, content=body, headers=all_headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if "context" in case[0] or "max_model_len" in case[0]:
        assert "256" in error["message"]  # says the numbers


def test_server_still_serves_after_bad_inputs(server, client):
    assert len(BAD_INPUTS) >= 25
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens >= 1


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def test_100_streaming_clients_disconnect_early(server, client):
    aborted_before = (
        metric_value(_metrics(server), "xlm:request_success_total", {"finished_reason": "abort"})
        or 0.0
    )

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"Story number {i}:",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            if i % 2 == 0:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one token, then hang up

    async def run() -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:
            await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(100))), 120)

    asyncio.run(run())
    deadline_text = ""
    for _ in range(120):  # the engine frees everything: no request left, no KV block used
        deadline_text = _metrics(server)
        if (
            metric_value(deadline_text, "xlm:kv_cache_usage_perc") == 0.0
            and metric_value(deadline_text, "xlm:num_requests_running") == 0.0
            and metric_value(deadline_text, "xlm:num_requests_waiting") == 0.0
        ):
            break
        asyncio.run(asyncio.sleep(0.5))
    assert metric_value(deadline_text, "xlm:kv_cache_usage_perc") == 0.0, deadline_text
    assert metric_value(deadline_text, "xlm:num_requests_running") == 0.0
    aborted = metric_value(deadline_text, "xlm:request_success_total", {"finished_reason": "abort"})
    assert aborted - aborted_before >= 95
    queued = metric_value(deadline_text, "xlm:request_queue_time_seconds_count")
    assert queued is not None and queued >= 50  # every request scheduled reported its wait
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
