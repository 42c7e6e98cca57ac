"""/v1/chat/completions over the stand-in engine (it answers the templated prompt's tokens
in a cycle), read by the official openai client: the prompt is the tokenizer's own chat
template over the flattened messages, choices per n with logprobs, the stream adds up to
the whole reply; and the message checks' 400s (the real engine: tests/e2e/test_server*.py)."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.test_api_server import MODEL, make_client
from xlm.entrypoints.openai.serving_chat import _finish_reason, normalize_messages
from xlm.entrypoints.openai.serving_engine import OpenAIError

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}],
    },
]
FLAT = [MESSAGES[0], {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def oai(tokenizer):
    """The openai client over the app in this process (no socket)."""
    with make_client(tokenizer, "--max-n", "4") as http:
        yield openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=http)


def _reference_ids(tokenizer) -> list[int]:
    """transformers' chat template over the flattened conversation."""
    ids = tokenizer.apply_chat_template(FLAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_reply_cycles_the_templated_prompt_with_logprobs_per_choice(oai, tokenizer):
    prompt = _reference_ids(tokenizer)
    reply = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=3, logprobs=True, top_logprobs=1
    )
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 6
    for j, choice in enumerate(reply.choices):
        ids = [prompt[(s + j) % len(prompt)] for s in range(3)]
        pieces = [tokenizer.decode([t]) for t in ids]
        assert choice.index == j and choice.message.role == "assistant"
        assert choice.message.content == "".join(pieces)
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        content = choice.logprobs.content
        assert [c.token for c in content] == pieces
        assert [c.logprob for c in content] == [-0.5] * 3
        assert all(bytes(c.bytes).decode() == c.token for c in content)


def test_the_stream_adds_up_to_the_whole_reply(oai):
    request = dict(model=MODEL, messages=MESSAGES, n=2, max_tokens=4)
    whole = oai.chat.completions.create(**request)
    chunks = list(
        oai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    texts: dict[int, str] = {}
    roles: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.delta.role:
                assert choice.index not in texts, "the role comes in the first delta"
                roles[choice.index] = choice.delta.role
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "robot", "content": "hi"}], "messages[0].role='robot' is invalid: allowed"),
        (["hi"], "messages[0] must be an object"),
        ([{"role": "user"}], "messages[0].content is missing"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "audio"}]}],
            "messages[0].content[0] of type 'audio' is not supported: only text parts",
        ),
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}]}],
            "messages[0].content[1] of type 'audio' is not supported: text and image_url",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
            "messages[0].tool_calls entries need function.name",
        ),
    ],
)
def test_bad_messages_are_400s_naming_the_message(messages, message):
    with pytest.raises(OpenAIError) as e:
        normalize_messages(messages)
    assert e.value.status == 400 and e.value.param == "messages"
    assert message in str(e.value)


def test_messages_as_chat_templates_read_them():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    text_call = {**call, "function": {"name": "g", "arguments": "not json"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
        {"role": "assistant", "content": None, "tool_calls": [call, text_call]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    user, assistant, tool = normalize_messages(messages)
    assert user["content"] == [{"type": "text", "text": "a"}, {"type": "image"}]
    assert assistant["content"] == ""
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"a": 1}, "not json"]
    assert tool == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not changed


def test_a_reply_that_stops_with_tool_calls_finishes_as_tool_calls():
    assert _finish_reason("stop", True) == "tool_calls"
    assert _finish_reason("length", True) == "length"
    assert _finish_reason("stop", False) == "stop"
