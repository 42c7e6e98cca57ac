"""Chat with `xlm serve` through the official openai client, streaming the reply.

xlm serve smollm2-135m --port 8000
python examples/openai_chat_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if any")
    parser.add_argument("--message", default="Give me three tips for writing clear code.")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are a concise, helpful assistant."},
        {"role": "user", "content": args.message},
    ]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=0.7,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(
                f"\n\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
                "completion tokens]"
            )


if __name__ == "__main__":
    main()
