"""The Responses handler over a stand-in engine: its reply is chat's for the same
conversation, results are stored (or not: store=false, a store of no entries, failed
ones), previous_response_id continues from the stored conversation, and GET / DELETE
answer stored ids and 404 unknown ones in OpenAI's shape.

The real engine and model are exercised by tests/e2e/test_server_responses.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser
from xlm.entrypoints.openai.engine_setup import ServerState
from xlm.entrypoints.openai.protocol import ChatCompletionRequest
from xlm.entrypoints.openai.responses_protocol import ResponsesRequest, ResponsesResponse
from xlm.entrypoints.openai.serving_engine import OpenAIError

MODEL = "m"
MAX_TOKENS = 24  # the stand-in engine echoes the prompt: 24 tokens cross </think>


class RecordingEngine(FakeAsyncEngine):
    """The stand-in engine, keeping each request's prompt token ids."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, max_model_len=512)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, *args, **kwargs):
        self.prompts.append(list(prompt.prompt_token_ids))
        async for output in super().generate(prompt, *args, **kwargs):
            yield output


def _state(tokenizer, *flags: str) -> ServerState:
    args = finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL, *flags])
    return ServerState(args, RecordingEngine(tokenizer), None)


def _respond(state: ServerState, **body) -> ResponsesResponse:
    request = ResponsesRequest.model_validate({"max_output_tokens": MAX_TOKENS, **body})
    return asyncio.run(state.responses.create_response(request))


def _chat(state: ServerState, messages: list[dict]):
    request = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_completion_tokens": MAX_TOKENS}
    )
    return asyncio.run(state.chat.create_chat_completion(request))


def _not_found(call, response_id: str, param: str | None = None) -> None:
    with pytest.raises(OpenAIError) as info:
        call()
    error = info.value.to_response().error
    assert info.value.status == 404 and error.code == "response_not_found"
    assert error.type == "invalid_request_error" and error.param == param
    assert error.message == f"Response with id '{response_id}' not found."


def _text(response: ResponsesResponse) -> str:
    (message,) = [item for item in response.output if item.type == "message"]
    return message.content[0].text


@pytest.fixture
def state(tokenizer):
    return _state(tokenizer)


def test_the_reply_is_chats_reply_for_the_same_conversation(tokenizer):
    state = _state(tokenizer, "--reasoning-parser", "deepseek_r1")
    response = _respond(state, input="x</think>y", instructions="s")
    chat = _chat(
        state, [{"role": "system", "content": "s"}, {"role": "user", "content": "x</think>y"}]
    )
    assert state.engine.prompts[0] == state.engine.prompts[1]
    message = chat.choices[0].message
    assert message.reasoning_content and message.content
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == message.reasoning_content
    assert _text(response) == message.content
    assert response.id.startswith("resp_") and response.model == MODEL
    # chat finished on "length": the fake engine runs to max_tokens
    assert response.status == "incomplete"
    assert response.incomplete_details == {"reason": "max_output_tokens"}
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    reasoning = tokenizer.encode(message.reasoning_content, add_special_tokens=False)
    assert usage.output_tokens_details.reasoning_tokens == len(reasoning) > 0


def test_a_stored_response_is_got_and_deleted_once(state):
    response = _respond(state, input="hi", metadata={"k": "v"})
    assert state.responses.retrieve(response.id) == response.model_dump()
    deleted = state.responses.delete(response.id)
    assert deleted.model_dump() == {"id": response.id, "object": "response", "deleted": True}
    _not_found(lambda: state.responses.retrieve(response.id), response.id)
    _not_found(lambda: state.responses.delete(response.id), response.id)


def test_unknown_ids_are_404s_and_run_nothing(state):
    _not_found(lambda: state.responses.retrieve("resp_nope"), "resp_nope")
    _not_found(lambda: state.responses.delete("resp_nope"), "resp_nope")
    ask = lambda: _respond(state, input="x", previous_response_id="resp_nope")  # noqa: E731
    _not_found(ask, "resp_nope", "previous_response_id")
    assert state.engine.prompts == []


def test_store_false_keeps_nothing_to_get_or_continue(state):
    response = _respond(state, input="hi", store=False)
    assert response.store is False and response.output
    _not_found(lambda: state.responses.retrieve(response.id), response.id)
    ask = lambda: _respond(state, input="x", previous_response_id=response.id)  # noqa: E731
    _not_found(ask, response.id, "previous_response_id")
    assert len(state.engine.prompts) == 1


def test_the_store_bounds_come_from_the_server_flags(tokenizer):
    none_kept = _state(tokenizer, "--responses-store-max-entries", "0")
    response = _respond(none_kept, input="hi")
    assert response.store is True
    _not_found(lambda: none_kept.responses.retrieve(response.id), response.id)
    one_kept = _state(tokenizer, "--responses-store-max-entries", "1")
    first, second = _respond(one_kept, input="a"), _respond(one_kept, input="b")
    _not_found(lambda: one_kept.responses.retrieve(first.id), first.id)
    assert one_kept.responses.retrieve(second.id)["id"] == second.id


def test_a_failed_response_is_not_kept(state):
    request = ResponsesRequest.model_validate({"input": "x"})
    response = ResponsesResponse.skeleton(request, "resp_failed", MODEL)
    response.status = "failed"
    state.responses.keep([{"type": "message", "role": "user", "content": "x"}], response)
    assert len(state.responses.store) == 0
    response.status = "completed"
    state.responses.keep([], response)
    assert state.responses.retrieve("resp_failed")["status"] == "completed"


def test_previous_response_id_prompts_with_the_stored_conversation(state):
    first = _respond(state, input="My name is Ada.", instructions="Be brief.")
    second = _respond(state, input="What is my name?", previous_response_id=first.id)
    third = _respond(
        state,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Spell it."}]}],
        previous_response_id=second.id,
    )
    assert second.previous_response_id == first.id
    # instructions are not carried over from an earlier response (as OpenAI's)
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "What is my name?"},
    ]
    _chat(state, conversation)
    assert state.engine.prompts[1] == state.engine.prompts[-1]
    conversation += [
        {"role": "assistant", "content": _text(second)},
        {"role": "user", "content": "Spell it."},
    ]
    _chat(state, conversation)
    assert state.engine.prompts[2] == state.engine.prompts[-1]
    assert third.status == "incomplete" and _text(third)


def test_a_streamed_response_is_stored_as_its_last_event_says(state):
    request = ResponsesRequest.model_validate(
        {"input": "hi", "stream": True, "max_output_tokens": MAX_TOKENS}
    )

    async def drain() -> list[str]:
        return [event async for event in await state.responses.create_response(request)]

    events = asyncio.run(drain())
    kinds = [event.split("\n", 1)[0].removeprefix("event: ") for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    last = json.loads(events[-1].split("\ndata: ", 1)[1])["response"]
    assert state.responses.retrieve(last["id"]) == last
    assert last["output"][0]["content"][0]["text"]
    follow = _respond(state, input="again", previous_response_id=last["id"])
    assert follow.previous_response_id == last["id"]
