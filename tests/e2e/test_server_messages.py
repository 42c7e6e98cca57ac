"""Anthropic's Messages API against a real `xlm serve` (SmolLM2), through the official
`anthropic` client, with the `openai` client on /v1/chat/completions as the reference:
the same conversation gives the same text (streamed and not), usage and token counts;
a forced tool call gives a tool_use block valid for the tool's schema and its tool_result
turn renders like the chat form; stop sequences and max_tokens give their stop reasons;
bad inputs are 4xx in Anthropic's error shape; schemathesis fuzzes the two routes.

One server for the module, with an API key (the anthropic client sends it as x-api-key).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server_utils import MODEL, RemoteServer, fuzz_for_server_errors
from tests.e2e.test_server_structured import WEATHER  # the chat tool tests' schema

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "messages-key"
SYSTEM = "You are a terse assistant."
ASK = {"role": "user", "content": "Name three colors."}
TOOL = {"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": TOOL["description"], "parameters": WEATHER},
}
WEATHER_ASK = {"role": "user", "content": "What is the weather in Paris?"}
# The anthropic client no longer has sampling arguments; the server still takes the fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--api-key", KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _create(client, **kwargs):
    kwargs.setdefault("messages", [ASK])
    kwargs.setdefault("max_tokens", 16)
    return client.messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def _stream(client, **kwargs):
    """(text from the text stream, the accumulated final message)."""
    kwargs.setdefault("messages", [ASK])
    kwargs.setdefault("max_tokens", 16)
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_equals_chat_completions_streamed_and_not(client, chat):
    reference = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, ASK],
        max_tokens=16,
        temperature=0,
    )
    choice = reference.choices[0]
    message = _create(client, system=SYSTEM)
    streamed_text, streamed = _stream(client, system=SYSTEM)
    assert choice.message.content and _text(message) == choice.message.content
    assert streamed_text == _text(streamed) == _text(message)
    expected_stop = {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    for m in (message, streamed):
        assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
        assert m.model == MODEL and m.stop_reason == expected_stop and m.stop_sequence is None
        assert m.usage.input_tokens == reference.usage.prompt_tokens
        assert m.usage.output_tokens == reference.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[ASK])
    assert counted.input_tokens == reference.usage.prompt_tokens


def test_max_tokens_and_stop_sequences_give_their_stop_reasons(client):
    short = _create(client, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    full = _text(_create(client))
    words = full.split()
    assert len(words) >= 2, full
    sequence = words[1]
    expected = full[: full.index(sequence)]
    stopped = _create(client, stop_sequences=["never-in-the-text", sequence])
    _, streamed = _stream(client, stop_sequences=["never-in-the-text", sequence])
    for m in (stopped, streamed):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == sequence
        assert _text(m) == expected


def test_forced_tool_use_validates_then_a_tool_result_turn_is_served(client, chat):
    forced = {"type": "tool", "name": "get_weather"}
    ask = {"messages": [WEATHER_ASK], "max_tokens": 60, "tools": [TOOL], "tool_choice": forced}
    message = _create(client, **ask)
    _, streamed = _stream(client, **ask)
    for m in (message, streamed):
        (call,) = [b for b in m.content if b.type == "tool_use"]
        assert call.id.startswith("toolu_") and call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER)
        assert m.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert [b for b in streamed.content if b.type == "tool_use"][0].input == call.input
    result = [{"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees and sunny"}]
    turns = [
        WEATHER_ASK,
        {
            "role": "assistant",
            "content": [b.model_dump(exclude_none=True) for b in message.content],
        },
        {"role": "user", "content": result},
    ]
    follow = _create(client, messages=turns, tools=[TOOL], max_tokens=8)
    arguments = json.dumps(call.input)
    function = {"name": "get_weather", "arguments": arguments}
    reference = chat.chat.completions.create(
        model=MODEL,
        messages=[
            WEATHER_ASK,
            {
                "role": "assistant",
                "content": _text(message) or None,
                "tool_calls": [{"id": call.id, "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"},
        ],
        tools=[CHAT_TOOL],
        max_tokens=8,
        temperature=0,
    )
    assert follow.usage.input_tokens == reference.usage.prompt_tokens
    assert _text(follow) == reference.choices[0].message.content


def _anthropic_error(body: dict, err_type: str) -> None:
    assert body["type"] == "error" and body["error"]["type"] == err_type, body
    assert body["error"]["message"]


def test_bad_inputs_are_anthropic_errors(server, client):
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL, "messages": [ASK]},
        headers={"x-api-key": KEY},
        timeout=60,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    _anthropic_error(r.json(), "invalid_request_error")
    for bad in (
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "no_such_tool"}},
        {"max_tokens": 100_000},  # more than the context (256) leaves
    ):
        with pytest.raises(anthropic.BadRequestError) as e:
            _create(client, **bad)
        _anthropic_error(e.value.body, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[ASK])
    _anthropic_error(e.value.body, "not_found_error")
    with pytest.raises(anthropic.AuthenticationError) as e:
        _create(client.with_options(api_key="wrong"))
    _anthropic_error(e.value.body, "authentication_error")
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)
    assert _create(bearer, max_tokens=2).usage.output_tokens == 2  # Authorization: Bearer too


def _not_anthropic_error(response) -> bool:
    if not 400 <= response.status_code < 500:
        return False
    body = response.json()
    return body.get("type") != "error" or "message" not in body.get("error", {})


def test_schemathesis_fuzz_of_the_messages_routes(server, client):
    pytest.importorskip("schemathesis")
    paths = {"/v1/messages", "/v1/messages/count_tokens"}
    fuzzed, failures = fuzz_for_server_errors(
        server.url,
        {"Authorization": f"Bearer {KEY}"},  # x-api-key opens the Messages routes only
        paths,
        examples=20,
        call_headers={"x-api-key": KEY},
        is_wrong=_not_anthropic_error,
    )
    assert fuzzed == paths
    assert not failures, "\n".join(failures[:10]) + "\n" + server.log_tail()
    assert _create(client, max_tokens=2).usage.output_tokens == 2  # still serving
