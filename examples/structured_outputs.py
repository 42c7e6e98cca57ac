"""Structured outputs with xlm.LLM: a JSON schema, a choice, a regex and a tool call.

    python examples/structured_outputs.py                     # built-in SmolLM2-135M
    python examples/structured_outputs.py --model DIR_OR_GGUF

Each request carries one ``StructuredOutputsParams``; the engine compiles it with
llguidance and masks every sampled token, so even a 135M model answers in the format.
Every engine option of `xlm generate` is accepted (--max-model-len, --token-buckets, ...).
The same constraints are available on the server (`response_format`, `tools` with
`tool_choice`, vLLM's `structured_outputs` / `guided_*` fields).
"""

from __future__ import annotations

import argparse
import json

import xlm
from xlm import SamplingParams, StructuredOutputsParams
from xlm.engine.arg_utils import EngineArgs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"enum": ["English", "French", "German"]},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=120, help="tokens per answer at most")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    llm = xlm.LLM.from_engine_args(EngineArgs.from_cli_args(args))

    def ask(question: str, **constraint) -> str:
        params = SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(**constraint),
        )
        messages = [{"role": "user", "content": question}]
        return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text

    # Compact JSON: at most one space between tokens (a small model otherwise pads with
    # newlines and indentation until max_tokens).
    person = ask(
        "Describe a person who speaks two languages.", json=PERSON, whitespace_pattern=r"[ ]?"
    )
    print(f"JSON: {json.dumps(json.loads(person))}")
    print(f"Choice: {ask('Is this review positive? It was great!', choice=['yes', 'no'])}")
    print(f"Regex: {ask('When did the war end?', regex=r'[0-9]{4}-[0-9]{2}-[0-9]{2}')}")

    # A tool call: constrain the reply to the arguments of the named function (what the
    # server does for tool_choice={"type": "function", "function": {"name": ...}}).
    function = WEATHER_TOOL["function"]
    params = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(
            json=function["parameters"], whitespace_pattern=r"[ ]?"
        ),
    )
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    reply = llm.chat(messages, params, tools=[WEATHER_TOOL], use_tqdm=False)[0].outputs[0].text
    print(f"Tool call: {function['name']}({json.dumps(json.loads(reply))})")


if __name__ == "__main__":
    main()
