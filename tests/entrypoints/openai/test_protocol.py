"""Protocol validation and the HTTP layer's error shapes, over a stand-in engine."""

from __future__ import annotations

import argparse
import json

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
)
from xlm.sampling_params import RequestOutputKind

MODEL = "test-model"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeAsyncEngine(tokenizer, max_model_len=64, max_logprobs=5)


@pytest.fixture(scope="module")
def client(engine):
    from xlm.entrypoints.openai.api_server import build_app
    from xlm.entrypoints.openai.cli_args import make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args([MODEL, "--api-key", "sekrit", "--max-logprobs", "5"])
    args.model = MODEL
    with TestClient(build_app(args, engine)) as c:
        c.headers["Authorization"] = "Bearer sekrit"
        yield c


def test_sampling_params_from_request():
    req = CompletionRequest(prompt="hi", temperature=0.5, top_k=3, stop="x", logit_bias={"7": 2})
    params = req.to_sampling_params()
    assert params.temperature == 0.5 and params.top_k == 3 and params.stop == ["x"]
    assert params.logit_bias == {7: 2.0} and params.max_tokens is None  # get_max_tokens decides
    assert params.output_kind == RequestOutputKind.DELTA  # accumulated by the handler
    assert not params.was_given("top_p")  # model defaults may apply
    stream = CompletionRequest(prompt="hi", stream=True, max_tokens=7)
    assert stream.to_sampling_params().output_kind == RequestOutputKind.DELTA
    assert stream.to_sampling_params().max_tokens == 7


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_invalid_completion_params_name_the_parameter(fields, param):
    req = CompletionRequest(prompt="hi", **fields)
    with pytest.raises(RequestValidationError) as info:
        req.to_sampling_params()
    assert info.value.param == param


def test_chat_request_rules():
    with pytest.raises(ValueError, match="stream_options"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream_options={})
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        logprobs=True,
        top_logprobs=3,
        max_completion_tokens=4,
    )
    params = req.to_sampling_params()
    assert params.logprobs == 3 and params.max_tokens == 4


def test_completion_and_usage(client, tokenizer):
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    n_prompt = len(tokenizer.encode("Hello world"))
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 3,
        "total_tokens": n_prompt + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["choices"][0]["finish_reason"] == "length"


def test_streaming_chat_shape(client):
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 2,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes.count("length") == 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -2}, 400, "temperature"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -1]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {}}, 400, None),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
            400,
            "messages",
        ),
    ],
)
def test_bad_inputs_get_openai_errors(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def test_malformed_bodies_and_auth(client):
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = client.post("/v1/completions", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    r = client.post("/tokenize", json={"prompt": "Hello"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    r = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.json()["prompt"] == "Hello"


def test_prompt_larger_than_the_kv_cache_is_a_400(tokenizer):
    from types import SimpleNamespace

    from xlm.entrypoints.openai.api_server import build_app
    from xlm.entrypoints.openai.cli_args import make_arg_parser

    engine = FakeAsyncEngine(tokenizer, max_model_len=64)
    engine.ready_info = {"num_blocks": 3}  # two usable blocks of 16: 32 tokens
    engine.xlm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([MODEL])
    args.model, args.api_key = MODEL, None
    with TestClient(build_app(args, engine)) as c:
        r = c.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 2})
        assert r.status_code == 400 and "holds only 32 tokens" in r.json()["error"]["message"]
        assert (
            c.post("/v1/completions", json={"prompt": [5] * 30, "max_tokens": 2}).status_code == 200
        )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 60}, "max_tokens"),  # prompt + 60 > max_model_len 64
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"logit_bias": {"1000000": 1}}, "logit_bias"),
        ({"min_tokens": 63, "max_tokens": None}, "min_tokens"),
        ({"logprobs": 6}, "logprobs"),  # over --max-logprobs 5
        ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ],
)
def test_llm_and_server_give_one_error_for_one_bad_parameter(client, engine, body, param):
    """One rule, one message: the server's 400 is the Processor's own error, which LLM raises."""
    prompt = "The capital of France is"
    ids = engine.tokenizer.encode(prompt)
    request = CompletionRequest(model=MODEL, prompt=prompt, **body)
    with pytest.raises(RequestValidationError) as raised:
        engine.processor.process_inputs(
            "r", ids, request.to_sampling_params(), default_max_tokens=16
        )
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == str(raised.value) and error["param"] == param
    assert raised.value.param == param
    for stream in (True, False):  # a streamed request gets its 400 before any event
        r = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "stream": stream, **body}
        )
        assert r.status_code == 400 and r.json()["error"]["message"] == str(raised.value)


def test_completion_without_max_tokens_is_capped_to_the_context_left(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 60})
    assert r.status_code == 200, r.text  # 4 tokens of room, under the default 16
    assert r.json()["usage"]["completion_tokens"] == 4
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 10})
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "16 > 64 - 60" in r.json()["error"]["message"]


def test_generation_config_max_new_tokens_applies_to_server_requests(tokenizer):
    from xlm.entrypoints.openai.api_server import build_app
    from xlm.entrypoints.openai.cli_args import make_arg_parser

    engine = FakeAsyncEngine(tokenizer, max_model_len=64)
    engine.processor.generation_config = {"max_new_tokens": 3}
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([MODEL])
    args.model, args.api_key = MODEL, None
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(build_app(args, engine)) as c:
        for path, body in (
            ("/v1/completions", {"prompt": [5] * 10}),
            ("/v1/chat/completions", {"messages": messages}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3, path
        r = c.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 5})
        assert r.json()["usage"]["completion_tokens"] == 5  # the request's own wins
