"""Each request rule runs once per server request: the handlers over a real AsyncLLM."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

import pytest

from tests.engine.reference import TINY_ENGINE
from xlm.engine import processor as processor_module
from xlm.engine.processor import Processor
from xlm.entrypoints.openai.messages_protocol import MessagesRequest
from xlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from xlm.entrypoints.openai.responses_protocol import ResponsesRequest
from xlm.sampling_params import SamplingParams
from xlm.structured_output.params import StructuredOutputsParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Every SamplingParams field with a rule of its own in SamplingParams._verify.
FIELD_RULES = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "bad_words",
    "structured_outputs",
)


def _count_rules(monkeypatch) -> Counter:
    """Wrap every validating function; the counter says how often each rule ran."""
    counts: Counter = Counter()

    def wrap(owner, name, key=None):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[key or name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    original_verify = SamplingParams._verify

    def verify(self, names=None):
        for field in names if names is not None else FIELD_RULES:
            counts[f"field:{field}"] += 1
        return original_verify(self, names)

    monkeypatch.setattr(SamplingParams, "_verify", verify)
    wrap(SamplingParams, "verify_min_tokens", "min_tokens <= max_tokens")
    wrap(SamplingParams, "verify_vocab", "token ids vs vocabulary")
    wrap(StructuredOutputsParams, "_verify", "structured outputs")
    wrap(Processor, "_check_prompt", "prompt: empty, vocabulary, length")
    wrap(Processor, "_check_logprobs", "logprobs cap")
    wrap(processor_module, "get_max_tokens", "max_tokens vs context")
    wrap(Processor, "process_inputs", "processor")
    return counts


def _server_state(engine):
    from prometheus_client import CollectorRegistry

    from xlm.entrypoints.openai.cli_args import make_arg_parser
    from xlm.entrypoints.openai.engine_setup import ServerState

    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["tiny"])
    return ServerState(args, engine, CollectorRegistry())


async def _drain(result) -> None:
    if hasattr(result, "__aiter__"):
        async for _ in result:
            pass


def test_each_rule_runs_once_per_server_request(tiny_checkpoint, monkeypatch):
    from xlm.engine.arg_utils import EngineArgs
    from xlm.engine.async_llm import AsyncLLM
    from xlm.engine.serial import MsgpackDecoder, MsgpackEncoder

    requests = {
        "completion text": CompletionRequest(
            prompt="hello world", max_tokens=3, min_tokens=1, logprobs=2, stop_token_ids=[5]
        ),
        "completion ids, no max_tokens": CompletionRequest(prompt=[5, 6, 7], temperature=0),
        "completion streamed, regex": CompletionRequest(
            prompt="hello", max_tokens=2, stream=True, structured_outputs={"regex": "[ab]+"}
        ),
        "chat": ChatCompletionRequest(
            messages=[{"role": "user", "content": "hello"}],
            max_completion_tokens=3,
            logprobs=True,
            top_logprobs=1,
        ),
        # Responses translate into one chat request: no rule of their own runs twice.
        "responses": ResponsesRequest.model_validate(
            {"input": "hello", "max_output_tokens": 3, "temperature": 0, "seed": 1}
        ),
        # Streamed: the tiny tokenizer fails constraints in the engine (an error event).
        "responses streamed, json_schema": ResponsesRequest.model_validate(
            {
                "input": "hello",
                "max_output_tokens": 3,
                "stream": True,
                "text": {"format": {"type": "json_schema", "name": "o", "schema": {}}},
            }
        ),
        "responses streamed, named tool": ResponsesRequest.model_validate(
            {
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                "instructions": "Be brief.",
                "max_output_tokens": 2,
                "stream": True,
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "f"},
            }
        ),
        "messages streamed, named tool": MessagesRequest(
            model="",
            max_tokens=3,
            stream=True,
            messages=[{"role": "user", "content": "hello"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "f"},
        ),
    }

    async def main() -> dict[str, tuple[Counter, Counter]]:
        engine = AsyncLLM.from_engine_args(
            # "used": only the programs these few requests run are compiled.
            EngineArgs(model=tiny_checkpoint("llama"), **dict(TINY_ENGINE, startup_programs="used"))
        )
        state = _server_state(engine)
        sent = []
        add = engine.engine_core.add_request_async

        async def capture(request):
            sent.append(request)
            return await add(request)

        engine.engine_core.add_request_async = capture
        counted: dict[str, tuple[Counter, Counter]] = {}
        try:
            for name, request in requests.items():
                counts = _count_rules(monkeypatch)
                sent.clear()
                if isinstance(request, ResponsesRequest):
                    await _drain(await state.responses.create_response(request))
                elif isinstance(request, MessagesRequest):
                    request.model = state.ctx.model_name  # Anthropic's model is required
                    await _drain(await state.messages.create_message(request))
                elif isinstance(request, ChatCompletionRequest):
                    await _drain(await state.chat.create_chat_completion(request))
                else:
                    await _drain(await state.completion.create_completion(request))
                # What the engine core does with the request: decode it off the socket.
                decoded = Counter()
                before = dict(counts)
                for core_request in sent:
                    MsgpackDecoder().decode(MsgpackEncoder().encode(core_request))
                decoded.update({k: counts[k] - before.get(k, 0) for k in counts})
                counted[name] = (Counter(before), +decoded)
                monkeypatch.undo()
        finally:
            engine.shutdown()
        return counted

    counted = asyncio.run(main())
    for name, (counts, decoded) in counted.items():
        assert counts["processor"] == 1, name
        for rule, n in counts.items():
            assert n == 1, f"{name}: {rule} ran {n} times"
        for rule in ("prompt: empty, vocabulary, length", "logprobs cap", "max_tokens vs context"):
            assert counts[rule] == 1, f"{name}: {rule} ran {counts[rule]} times"
        assert all(counts[f"field:{f}"] == 1 for f in FIELD_RULES), name
        assert counts["min_tokens <= max_tokens"] == 1, name
        assert not decoded, f"{name}: decoding in the engine core re-validated {dict(decoded)}"
    assert counted["completion streamed, regex"][0]["structured outputs"] == 1
    assert counted["responses streamed, json_schema"][0]["structured outputs"] == 1
    assert counted["responses streamed, named tool"][0]["structured outputs"] == 1
    assert counted["messages streamed, named tool"][0]["structured outputs"] == 1
