"""/v1/messages over a stand-in engine, through the official anthropic client: the reply
equals the chat route's for the same conversation (thinking split by the server's reasoning
parser included), streamed events rebuild the same message, the handler's errors reach the
SDK as its typed errors, and run-batch answers `/v1/messages` lines with the route's own body.

The routes' own layer (the error-shape middleware, x-api-key) is tested in
tests/entrypoints/openai/routes/test_messages.py; the real engine and model by
tests/e2e/test_server_messages.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.entrypoints.openai.api_server import build_app
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser
from xlm.entrypoints.openai.engine_setup import ServerState
from xlm.entrypoints.openai.serving_messages import MessagesStream
from xlm.entrypoints.run_batch import answer

anthropic = pytest.importorskip("anthropic")

KEY = "sekrit"
BEARER = {"Authorization": f"Bearer {KEY}"}
MODEL = "m"
# A 2x2 PNG: a valid image, refused by the text-only model.
PNG_SOURCE = {
    "type": "base64",
    "media_type": "image/png",
    "data": "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAC0lEQVR4nGNgQAYAAA4AAamRc7EAAAAA"
    "SUVORK5CYII=",
}
SYSTEM = "s"
USER = "x</think>y"  # the stand-in engine echoes the prompt: its reply crosses </think>
FLAGS = ["--api-key", KEY, "--reasoning-parser", "deepseek_r1", "--max-n", "4"]


def _args(*flags: str) -> argparse.Namespace:
    return finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL, *flags])


@pytest.fixture(scope="module")
def http(tokenizer):
    with TestClient(build_app(_args(*FLAGS), FakeAsyncEngine(tokenizer, 128))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0
    )


def _ask(**kwargs):
    body = {"model": MODEL, "max_tokens": 24, "system": SYSTEM}
    body["messages"] = [{"role": "user", "content": USER}]
    return {**body, **kwargs}


def _chat(http, **kwargs) -> dict:
    body = {"model": MODEL, "max_tokens": 24, **kwargs}
    body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    r = http.post("/v1/chat/completions", json=body, headers=BEARER)
    assert r.status_code == 200, r.text
    return r.json()


def _blocks(message) -> dict[str, str]:
    return {b.type: getattr(b, "text", None) or getattr(b, "thinking", "") for b in message.content}


def test_message_equals_the_chat_reply_streamed_or_not(http, client):
    chat = _chat(http)
    choice = chat["choices"][0]
    assert choice["message"]["reasoning_content"] and choice["message"]["content"]
    message = client.messages.create(**_ask())
    with client.messages.stream(**_ask()) as stream:
        streamed = stream.get_final_message()
    for m in (message, streamed):
        assert m.id.startswith("msg_") and m.role == "assistant" and m.model == MODEL
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert _blocks(m) == {
            "thinking": choice["message"]["reasoning_content"],
            "text": choice["message"]["content"],
        }
        assert m.stop_reason == "max_tokens" and choice["finish_reason"] == "length"
        assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert m.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_stream_events_carry_event_lines_matching_their_type(http):
    r = http.post("/v1/messages", json=_ask(stream=True), headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    kinds = []
    for raw in r.text.strip().split("\n\n"):
        event_line, data_line = raw.split("\n")
        kind = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == kind
        kinds.append(kind)
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2


def test_count_tokens_equals_the_chat_prompt(http, client):
    ask = _ask()
    del ask["max_tokens"]
    counted = client.messages.count_tokens(**ask)
    assert counted.input_tokens == _chat(http)["usage"]["prompt_tokens"]


def _anthropic_error(r, status: int, err_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == err_type and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize(
    "change, status, err_type, says",
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [{"role": "bot", "content": "x"}]}, 400, "invalid_request_error", "role"),
        ({"max_tokens": 10_000}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "nope"}, 404, "not_found_error", "nope"),
        (
            {
                "tools": [{"name": "f", "input_schema": {}}],
                "tool_choice": {"type": "tool", "name": "g"},
            },
            400,
            "invalid_request_error",
            "'g'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "image",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": PNG_SOURCE}]}]},
            400,
            "invalid_request_error",
            "text only",
        ),
    ],
)
def test_bad_requests_are_anthropic_errors(http, change, status, err_type, says):
    body = {k: v for k, v in _ask(**change).items() if v is not None}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert says in _anthropic_error(r, status, err_type)


def test_sdk_raises_its_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**_ask(max_tokens=10_000))
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**_ask(model="nope"))
    wrong = client.with_options(api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(**_ask())
    assert e.value.body["error"]["type"] == "authentication_error"


def test_run_batch_answers_messages_lines_with_the_routes_body(tokenizer, http):
    state = ServerState(_args(*FLAGS), FakeAsyncEngine(tokenizer, 128), None)
    record = {"custom_id": "a", "method": "POST", "url": "/v1/messages", "body": _ask()}
    result = asyncio.run(answer(state, record))
    assert result["error"] is None and result["response"]["status_code"] == 200
    body = result["response"]["body"]
    served = http.post("/v1/messages", json=_ask(), headers=BEARER).json()
    assert body["type"] == "message" and result["response"]["request_id"] == body["id"]
    assert body["content"] == served["content"] and body["usage"] == served["usage"]
    bad = asyncio.run(answer(state, {**record, "body": _ask(max_tokens=10_000)}))
    assert bad["response"]["status_code"] == 400 and "max_tokens" in bad["error"]["message"]


def _rebuild(chunks: list[dict]):
    """The message the anthropic client's stream accumulator builds from our events."""
    from anthropic.lib.streaming._messages import accumulate_event

    stream = MessagesStream()
    events = [e for chunk in chunks for e in stream.feed(chunk)] + list(stream.end())
    snapshot, json_bufs = None, {}
    for raw in events:
        data = json.loads(raw.split("\ndata: ", 1)[1])
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot, events


def _chunk(delta: dict, finish: str | None = None, usage=(7, 3), stop=None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}
    return {
        "id": "chatcmpl-abc",
        "model": MODEL,
        "choices": [choice],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
    }


def test_streamed_tool_calls_rebuild_as_tool_use_blocks():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    chunks = [
        {"id": "chatcmpl-abc", "model": MODEL, "choices": [{"index": 0, "delta": {"role": "a"}}]},
        _chunk({"content": "Let me look."}),
        _chunk({"tool_calls": [{**call, "function": {"name": "f", "arguments": '{"ci'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
        _chunk({"tool_calls": [{**call, "index": 1, "id": "call_2"}]}),
        _chunk({}, finish="tool_calls", usage=(7, 9)),
    ]
    message, events = _rebuild(chunks)
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me look."
    assert message.content[1].input == {"city": "Paris"} and message.content[1].name == "f"
    assert [b.id for b in message.content[1:]] == ["toolu_1", "toolu_2"]
    assert message.id == "msg_abc" and message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 7 and message.usage.output_tokens == 9


def test_stream_stop_sequence_abort_and_error():
    message, _ = _rebuild([_chunk({"content": "Hi"}, finish="stop", stop="END")])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    _, events = _rebuild([_chunk({"content": "Hi"}), _chunk({}, finish="abort")])
    assert events[-1].startswith("event: error") and "overloaded_error" in events[-1]
    stream = MessagesStream()
    failed = list(stream.feed({"error": {"message": "boom", "type": "server_error"}}))
    failed += list(stream.end())
    assert len(failed) == 1 and '"api_error"' in failed[0] and "boom" in failed[0]
