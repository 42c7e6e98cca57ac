"""Messages request -> chat request: a tool conversation renders through the chat template
exactly as its hand-written chat form does (Hugging Face's apply_chat_template as the
reference); misplaced blocks are 400s; stop reasons map as Anthropic names them."""

from __future__ import annotations

import pytest

from xlm.entrypoints.openai.messages_protocol import CountTokensRequest, MessagesRequest
from xlm.entrypoints.openai.messages_translate import chat_request, stop_reason, tool_input
from xlm.entrypoints.openai.serving_engine import OpenAIError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 degrees"},
            {"type": "text", "text": "Thanks!"},
        ],
    },
]
# The same conversation as an OpenAI chat client writes it.
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_1", "content": "22 degrees"},
    {"role": "user", "content": "Thanks!"},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": WEATHER,
            "description": "Weather of a city",
        },
    }
]


def test_a_tool_conversation_renders_like_its_chat_form(tokenizer):
    from xlm.entrypoints.openai.serving_chat import normalize_messages

    request = CountTokensRequest(
        model="m",
        system=[{"type": "text", "text": "Be brief."}],
        messages=CONVERSATION,
        tools=TOOLS,
    )
    chat = chat_request(request)
    assert chat.tools == CHAT_TOOLS
    ours = tokenizer.apply_chat_template(
        normalize_messages(chat.messages), tools=chat.tools, add_generation_prompt=True
    )
    reference = tokenizer.apply_chat_template(CHAT, tools=CHAT_TOOLS, add_generation_prompt=True)
    assert ours == reference and "22 degrees" in tokenizer.decode(ours)


def test_sampling_fields_and_tool_choice_reach_the_chat_request():
    request = MessagesRequest(
        model="m",
        max_tokens=7,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        stop_sequences=["END"],
        top_k=3,
    )
    chat = chat_request(request, max_tokens=7, stop=["END"], top_k=3, temperature=None)
    params = chat.to_sampling_params()
    assert (params.max_tokens, params.stop, params.top_k) == (7, ["END"], 3)
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert params.structured_outputs is not None  # the named tool's schema constrains it
    for kind, chat_choice in (("any", "required"), ("auto", "auto"), ("none", "none")):
        other = MessagesRequest.model_validate(
            {**request.model_dump(), "tool_choice": {"type": kind}}
        )
        assert chat_request(other).tool_choice == chat_choice


@pytest.mark.parametrize(
    "messages, says",
    [
        (
            [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
            "assistant",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ],
            "user",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "image", "source": {}}],
                        }
                    ],
                }
            ],
            "image",
        ),
    ],
)
def test_misplaced_blocks_are_400s(messages, says):
    with pytest.raises(OpenAIError) as e:
        chat_request(CountTokensRequest(model="m", messages=messages))
    assert e.value.status == 400 and says in e.value.message


def test_image_blocks_become_chats_image_url_parts_in_order():
    image = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    content = [
        {"type": "image", "source": image},
        {"type": "text", "text": "What is it?"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
    ]
    chat = chat_request(
        CountTokensRequest(model="m", messages=[{"role": "user", "content": content}])
    )
    assert chat.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        }
    ]


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"type": "base64", "media_type": "text/plain", "data": "aGk="}, "media_type"),
        ({"type": "base64", "media_type": "image/png"}, "data"),
        ({"type": "file", "file_id": "f"}, "'file'"),
    ],
)
def test_bad_image_sources_are_400s(source, says):
    content = [{"type": "image", "source": source}]
    with pytest.raises(OpenAIError) as e:
        chat_request(CountTokensRequest(model="m", messages=[{"role": "user", "content": content}]))
    assert e.value.status == 400 and says in e.value.message


def test_stop_reasons_and_tool_inputs():
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("stop", None) == ("end_turn", None)
    assert stop_reason("stop", 2) == ("end_turn", None)  # a stop token id, not a sequence
    with pytest.raises(OpenAIError) as e:
        stop_reason("abort", None)
    assert e.value.status == 503
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input('{"a": ') == {} and tool_input("[1]") == {} and tool_input("") == {}
