"""POST /v1/responses through a real `xlm serve` and the openai client, against chat
completions on the same server: the same text at temperature 0 (streamed and not),
function calls, text.format, reasoning items, previous_response_id, the stored
responses, and OpenAI-shaped errors.

One server for the module (SmolLM2, the qwen3 reasoning parser, as the structured-output
tests start it), small max tokens.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.e2e.server_utils import MODEL, RemoteServer, metric_value

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
from openai.types.responses import Response  # noqa: E402

from tests.e2e.test_server_structured import SCHEMAS, THINK_REGEX, TIME, WEATHER  # noqa: E402

pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a color of the sky."},
]
TOOLS = [
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
STORE_ENTRIES = 4


@pytest.fixture(scope="module")
def server():
    flags = ["--reasoning-parser", "qwen3", "--structured-outputs-enable-in-reasoning"]
    flags += ["--responses-store-max-entries", str(STORE_ENTRIES)]
    with RemoteServer(flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def respond(client, **kwargs):
    kwargs.setdefault("max_output_tokens", 12)
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def chat_text(client, messages, max_tokens=12):
    """(text, usage, finish_reason) of the chat completion of the same conversation."""
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    choice = response.choices[0]
    return choice.message.content, response.usage, choice.finish_reason


def collect(events) -> tuple[dict, list]:
    """Raw streamed events -> (per-type concatenated deltas and done texts, the events)."""
    events = list(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert all(e.response.id == events[0].response.id for e in events if hasattr(e, "response"))
    texts: dict[str, str] = {}
    for e in events:
        if e.type.endswith(".delta"):
            texts[e.type] = texts.get(e.type, "") + e.delta
    return texts, events


@pytest.mark.parametrize("stream", [False, True])
def test_text_equals_chat_completion(client, stream):
    expected, usage, finish = chat_text(client, CONVERSATION)
    instructions, user = CONVERSATION[0]["content"], CONVERSATION[1]["content"]
    if not stream:
        response = respond(client, instructions=instructions, input=[CONVERSATION[1]])
        assert response.output_text == expected
        final = response
    else:
        stream_ = respond(client, instructions=instructions, input=user, stream=True)
        texts, events = collect(stream_)
        assert texts["response.output_text.delta"] == expected
        done = [e for e in events if e.type == "response.output_text.done"]
        assert [e.text for e in done] == [expected]
        final = events[-1].response
        assert final.output_text == expected
    assert final.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.input_tokens == usage.prompt_tokens
    assert final.usage.output_tokens == usage.completion_tokens
    assert final.usage.total_tokens == usage.total_tokens


def test_streamed_event_sequence_parses_in_the_typed_stream(client):
    with client.responses.stream(
        model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
    item = [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert compact == ["response.created", "response.in_progress", *item, "response.incomplete"]


def _check_calls(output, names):
    calls = [item for item in output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in output)
    for call in calls:
        assert call.name in names and call.call_id and call.id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_validate_against_the_tool_schema(client, stream):
    ask = "What is the weather in Paris?"
    if not stream:
        named = {"type": "function", "name": "get_time"}
        response = respond(client, input=ask, tools=TOOLS, tool_choice=named, max_output_tokens=40)
        assert response.tool_choice.name == "get_time"
        _check_calls(response.output, {"get_time"})
        return
    with client.responses.stream(
        model=MODEL,
        input=ask,
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        temperature=0,
    ) as stream_:
        events = list(stream_)
        final = stream_.get_final_response()
    calls = _check_calls(final.output, set(SCHEMAS))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [c.arguments for c in calls] and "".join(deltas) == "".join(done)
    assert final.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema(client, stream):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    kwargs = dict(input="Describe a person.", text={"format": fmt}, max_output_tokens=60)
    if stream:
        texts, events = collect(respond(client, stream=True, **kwargs))
        text, final = texts["response.output_text.delta"], events[-1].response
    else:
        final = respond(client, **kwargs)
        text = final.output_text
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert final.status == "completed" and final.text.format.type == "json_schema"
    obj = respond(
        client, input='Reply with {"ok": true}.', text={"format": {"type": "json_object"}}
    )
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_a_reasoning_item(client, stream):
    extra = {"structured_outputs": {"regex": THINK_REGEX}}
    kwargs = dict(input="Think, then answer.", max_output_tokens=60, extra_body=extra)
    if stream:
        texts, events = collect(respond(client, stream=True, **kwargs))
        final = events[-1].response
        assert texts["response.reasoning_text.delta"] == final.output[0].content[0].text
    else:
        final = respond(client, **kwargs)
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert re.fullmatch(r"[a-z ]{5,30}", reasoning.content[0].text)
    assert re.fullmatch(r"[A-Z][a-z ]{5,30}\.", final.output_text)
    assert 0 < final.usage.output_tokens_details.reasoning_tokens < final.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = respond(client, input="My name is Ada.", max_output_tokens=6)
    second = respond(
        client, input="What is my name?", previous_response_id=first.id, max_output_tokens=6
    )
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    expected, usage, _ = chat_text(client, history, max_tokens=6)
    assert second.output_text == expected
    assert second.usage.input_tokens == usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    # A function call answered by its output: the prompt chat renders for the same turns.
    call = respond(client, input="Time?", tools=TOOLS, tool_choice="required", max_output_tokens=60)
    fc = call.output[0]
    answer = respond(
        client,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "9 o'clock"}],
        previous_response_id=call.id,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
    )
    turns = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": fc.call_id,
                    "type": "function",
                    "function": {"name": fc.name, "arguments": fc.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": fc.call_id, "content": "9 o'clock"},
    ]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=turns,
        tools=[
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in TOOLS
        ],
        tool_choice="none",
        max_tokens=4,
        temperature=0,
    )
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens > call.usage.input_tokens


def test_stored_responses_get_delete_and_store_false(client):
    response = respond(client, input="Hello.", max_output_tokens=3)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    unstored = respond(client, input="Hello.", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        respond(client, input="Again.", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "response_not_found"


def test_the_store_keeps_the_newest_entries_the_flag_allows(client):
    ids = [respond(client, input=f"Count {i}.", max_output_tokens=1).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_a_stream_the_client_leaves_is_aborted_in_the_engine(server):
    def aborted() -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return metric_value(text, "xlm:request_success_total", {"finished_reason": "abort"}) or 0

    before = aborted()
    body = {"model": MODEL, "input": "Tell a long story.", "stream": True}
    body["max_output_tokens"] = 200
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break  # one token, then hang up
    for _ in range(120):
        text = httpx.get(server.url + "/metrics", timeout=10).text
        if metric_value(text, "xlm:num_requests_running") == 0.0:
            break
        time.sleep(0.5)
    assert metric_value(text, "xlm:num_requests_running") == 0.0
    assert metric_value(text, "xlm:kv_cache_usage_perc") == 0.0
    assert aborted() == before + 1


def test_bodies_validate_against_the_sdk_models(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "instructions": "Be kind."}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())  # strict: every required field, right types
    assert response.object == "response" and response.instructions == "Be kind."
    assert response.output[0].content[0].type == "output_text"


BAD = [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input"),
    (
        {"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
        400,
        None,
    ),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, 400, "tool_choice"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, 400, None),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": 5}, 400, "input"),
    ({}, 400, "input"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_inputs_are_answered_in_openai_shape(server, body, status, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "response_not_found"
