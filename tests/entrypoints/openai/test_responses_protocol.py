"""The Responses models: admission counts one sequence per request, statuses from
chat's finish reasons, and the body the openai SDK validates."""

from __future__ import annotations

import pytest

from xlm.entrypoints.openai.admission import request_cost
from xlm.entrypoints.openai.protocol import UsageInfo
from xlm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)


def test_a_list_input_is_one_sequence_for_admission():
    items = [{"role": "user", "content": f"turn {i}"} for i in range(10)]
    request = ResponsesRequest.model_validate({"input": items})
    assert request.input_ == items and request_cost(request) == 1
    assert "input" in ResponsesRequest.model_json_schema()["required"]


@pytest.mark.parametrize(
    ("finish", "status", "details", "last_status"),
    [
        ("stop", "completed", None, "completed"),
        ("tool_calls", "completed", None, "completed"),
        ("length", "incomplete", {"reason": "max_output_tokens"}, "incomplete"),
        ("abort", "incomplete", None, "incomplete"),
    ],
)
def test_finish_reasons_set_the_status(finish, status, details, last_status):
    request = ResponsesRequest.model_validate({"input": "x", "tool_choice": "required"})
    response = ResponsesResponse.skeleton(request, "resp_1", "m")
    response.output = [
        OutputMessage(content=[OutputText(text="a")]),
        FunctionCallItem(call_id="c", name="f"),
    ]
    usage = UsageInfo(prompt_tokens=5, completion_tokens=2, total_tokens=7)
    response.finish(finish, ResponseUsage.from_chat(usage))
    assert (response.status, response.incomplete_details) == (status, details)
    assert [item.status for item in response.output] == ["completed", last_status]
    assert response.tool_choice == "required"


def test_the_body_validates_against_the_sdk_model():
    openai_responses = pytest.importorskip("openai.types.responses")
    request = ResponsesRequest.model_validate(
        {"input": "x", "instructions": "hi", "metadata": {"k": "v"}, "store": False}
    )
    response = ResponsesResponse.skeleton(request, "resp_1", "m")
    response.output = [OutputMessage(content=[OutputText(text="a")])]
    usage = UsageInfo(prompt_tokens=5, completion_tokens=1, total_tokens=6)
    response.finish("stop", ResponseUsage.from_chat(usage))
    parsed = openai_responses.Response.model_validate(response.model_dump())
    assert parsed.output_text == "a" and parsed.store is False
    assert parsed.usage.input_tokens_details.cached_tokens == 0
