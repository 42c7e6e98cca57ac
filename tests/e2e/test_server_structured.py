"""Structured outputs, tool calls and reasoning through a real `xlm serve` and the openai
client: response_format, vLLM's extra fields, tool_choice required / named / auto
(hermes), role "tool" messages, reasoning_content; streamed and not.

One server for the module, started with the qwen3 reasoning parser, constraints applied
from the first token (so a regex can force a <think> block out of SmolLM2), and hermes
auto tool choice.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.server_utils import MODEL, RemoteServer

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_REGEX = r"<think>[a-z ]{5,30}</think>[A-Z][a-z ]{5,30}\."


@pytest.fixture(scope="module")
def server():
    flags = [
        "--reasoning-parser",
        "qwen3",
        "--structured-outputs-enable-in-reasoning",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
    ]
    with RemoteServer(flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def create(client, stream=False, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, temperature=0, stream=stream, **kwargs)


def collect(stream):
    """Streamed chunks -> (content, reasoning_content, tool calls by index, finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    response = create(client, stream, response_format=fmt)
    if stream:
        text, _, _, finish = collect(response)
    else:
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert set(value) == {"name", "age"}  # strict: no additional properties
    assert finish == "stop"


def test_json_object_and_vllm_extra_fields(client):
    short = [{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}]
    obj = create(client, messages=short, response_format={"type": "json_object"}, max_tokens=120)
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = create(client, extra_body={"guided_choice": ["sunny", "rainy"]}).choices[0]
    assert choice.message.content in ("sunny", "rainy")
    regex = create(client, extra_body={"guided_regex": r"[0-9]{2} degrees"}).choices[0]
    assert re.fullmatch(r"[0-9]{2} degrees", regex.message.content)
    so = create(client, extra_body={"structured_outputs": {"choice": ["a", "b"]}}).choices[0]
    assert so.message.content in ("a", "b")
    completion = client.completions.create(
        model=MODEL,
        prompt="The year is",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": r" [0-9]{4}"},
    )
    assert re.fullmatch(r" [0-9]{4}", completion.choices[0].text)


def test_invalid_constraints_are_400(client):
    for extra in (
        {"guided_regex": "[unclosed"},
        {"guided_json": {"type": "no-such-type"}},
        {"guided_choice": []},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"response_format": {"type": "yaml"}},
    ):
        with pytest.raises(openai.BadRequestError):
            create(client, extra_body=extra)
    with pytest.raises(openai.BadRequestError):
        create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    assert create(client, max_tokens=3).choices[0].finish_reason == "length"  # still serving


def _check_calls(calls, finish, names=None):
    assert finish == "tool_calls"
    assert calls
    for name, arguments in calls:
        assert name in SCHEMAS and (names is None or name in names)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(client, stream):
    response = create(client, stream, tools=TOOLS, tool_choice="required", max_tokens=120)
    if stream:
        content, _, calls, finish = collect(response)
        assert all(c["id"] for c in calls.values())
        pairs = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = response.choices[0]
        content, finish = choice.message.content, choice.finish_reason
        pairs = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert all(c.id and c.type == "function" for c in choice.message.tool_calls)
    assert not content
    _check_calls(pairs, finish)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = create(client, stream, tools=TOOLS, tool_choice=named)
    if stream:
        content, _, calls, finish = collect(response)
        pairs = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = response.choices[0]
        content, finish = choice.message.content, choice.finish_reason
        pairs = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert not content
    _check_calls(pairs, finish, names={"get_time"})
    assert len(pairs) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_hermes_calls(client, stream):
    # Force the model's own hermes-format call with a regex, then let the parser find it.
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
    call += r'"unit": "celsius"\}\}</tool_call>'
    response = create(
        client, stream, tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": call}
    )
    if stream:
        content, _, calls, finish = collect(response)
        pairs = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = response.choices[0]
        content, finish = choice.message.content, choice.finish_reason
        pairs = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert not content
    _check_calls(pairs, finish, names={"get_weather"})
    # Plain replies stay content.
    plain = create(client, tools=TOOLS, tool_choice="auto", max_tokens=8).choices[0]
    assert plain.message.content and not plain.message.tool_calls
    assert plain.finish_reason == "length"


def test_tool_results_go_through_the_chat_template(client):
    from xlm.tokenizer import get_tokenizer

    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
    ]
    response = create(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5)
    tokenizer = get_tokenizer(MODEL)
    rendered = tokenizer.apply_chat_template(
        [dict(m, content=m["content"] or "") for m in messages],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "22 degrees and sunny" in rendered
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_split(client, stream):
    response = create(client, stream, extra_body={"guided_regex": THINK_REGEX})
    if stream:
        content, reasoning, _, finish = collect(response)
    else:
        message = response.choices[0].message
        content, reasoning = message.content, message.reasoning_content
        finish = response.choices[0].finish_reason
    assert re.fullmatch(r"[a-z ]{5,30}", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z ]{5,30}\.", content), content
    assert "<think>" not in content and finish == "stop"
