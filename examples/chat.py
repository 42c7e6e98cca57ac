"""Chat: send a system and a user message through the model's chat template; print the reply.

    python examples/chat.py                                   # built-in SmolLM2-135M
    python examples/chat.py --message "Why is the sky blue?" --model DIR_OR_GGUF

Every engine option of `xlm generate` is accepted (--max-model-len, --token-buckets, ...).
For an interactive conversation on the terminal, run `xlm chat`.
"""

from __future__ import annotations

import argparse

import xlm
from xlm.engine.arg_utils import EngineArgs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--system", default="You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    )
    parser.add_argument("--message", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens in the reply")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()

    llm = xlm.LLM.from_engine_args(EngineArgs.from_cli_args(args))
    messages = [
        {"role": "system", "content": args.system},
        {"role": "user", "content": args.message},
    ]
    params = xlm.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    reply = llm.chat(messages, params)[0].outputs[0].text
    print(f"User:      {args.message}")
    print(f"Assistant: {reply}")


if __name__ == "__main__":
    main()
