"""Chat stream chunks -> Responses events: the order, sequence numbers and items, checked
by replaying the events through the openai SDK's own stream state (what
`client.responses.stream()` runs)."""

from __future__ import annotations

import asyncio
import json

import pytest

from xlm.entrypoints.openai.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)
from xlm.entrypoints.openai.responses_protocol import ResponsesRequest, ResponsesResponse
from xlm.entrypoints.openai.responses_stream import ResponseEventStream
from xlm.entrypoints.openai.serving_engine import SSE_DONE, OpenAIError, sse

openai = pytest.importorskip("openai")
from openai._models import construct_type  # noqa: E402
from openai.lib.streaming.responses._responses import ResponseStreamState  # noqa: E402
from openai.types.responses import ResponseStreamEvent  # noqa: E402


def _chunk(finish=None, usage=None, **delta):
    choices = []
    if usage is None:
        choice = ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(**delta), finish_reason=finish
        )
        choices.append(choice)
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=0, model="m", choices=choices, usage=usage
    )
    return sse(chunk)


def _call(index, arguments, name=None):
    head = dict(id=f"call_{index}", type="function") if name else {}
    function = DeltaFunctionCall(name=name, arguments=arguments)
    return DeltaToolCall(index=index, function=function, **head)


def _run(chunks):
    """(event dicts, the SDK's final response, what on_done stored)."""
    kept = []

    async def chat():
        for chunk in chunks:
            yield chunk

    async def collect():
        request = ResponsesRequest.model_validate({"input": "x"})
        response = ResponsesResponse.skeleton(request, "resp_1", "m")
        stream = ResponseEventStream(response, lambda text: len(text.split()), kept.append)
        return [event async for event in stream.stream(chat())]

    raw = asyncio.run(collect())
    events = []
    for text in raw:
        name_line, data_line, *_ = text.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    state = ResponseStreamState(input_tools=[], text_format=openai.NOT_GIVEN)
    for data in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    final = state._completed_response
    return events, final, kept


USAGE = UsageInfo(prompt_tokens=7, completion_tokens=9, total_tokens=16)


def test_reasoning_then_text_in_order_with_contiguous_sequence_numbers():
    chunks = [
        _chunk(role="assistant", content=""),
        _chunk(reasoning_content="let me "),
        _chunk(reasoning_content="think"),
        _chunk(content="Blue"),
        _chunk(content=" sky.", finish="stop"),
        _chunk(usage=USAGE),
        SSE_DONE,
    ]
    events, final, kept = _run(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["output_index"] for e in events if e["type"].endswith("item.added")] == [0, 1]
    assert final.status == "completed" and final.output_text == "Blue sky."
    reasoning, message = final.output
    assert reasoning.content[0].text == "let me think" and message.status == "completed"
    usage = final.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (7, 9, 16)
    assert usage.output_tokens_details.reasoning_tokens == 3  # the counter given: words
    assert [r.id for r in kept] == ["resp_1"]


def test_tool_calls_stream_argument_deltas_per_call():
    chunks = [
        _chunk(role="assistant", content=""),
        _chunk(tool_calls=[_call(0, '{"zone": ', name="get_time")]),
        _chunk(tool_calls=[_call(0, '"UTC"}')]),
        _chunk(tool_calls=[_call(1, '{"city": "Oslo"}', name="get_weather")], finish="tool_calls"),
        _chunk(usage=USAGE),
        SSE_DONE,
    ]
    events, final, _ = _run(chunks)
    deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    done = [e for e in events if e["type"].endswith("arguments.done")]
    assert deltas == ['{"zone": ', '"UTC"}', '{"city": "Oslo"}']
    assert [(e["name"], e["arguments"]) for e in done] == [
        ("get_time", '{"zone": "UTC"}'),
        ("get_weather", '{"city": "Oslo"}'),
    ]
    calls = [(c.call_id, c.name, c.arguments) for c in final.output]
    assert calls == [
        ("call_0", "get_time", '{"zone": "UTC"}'),
        ("call_1", "get_weather", '{"city": "Oslo"}'),
    ]


def test_length_is_incomplete_and_an_engine_error_fails():
    events, _, kept = _run([_chunk(content="Blue", finish="length"), _chunk(usage=USAGE)])
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete" and kept
    error = OpenAIError("The engine failed the request: boom", status=500, err_type="server_error")
    events, _, kept = _run([_chunk(content="Bl"), sse(error.to_response()), SSE_DONE])
    last = events[-1]
    assert last["type"] == "response.failed" and not kept
    assert last["response"]["status"] == "failed"
    assert "boom" in last["response"]["error"]["message"]
