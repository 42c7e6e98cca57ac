"""Query `xlm serve` with the official openai client: a completion, then a streamed one.

xlm serve smollm2-135m --port 8000
python examples/openai_completion_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if any")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    completion = client.completions.create(
        model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    print(f"{args.prompt}{choice.text!s}")
    print(f"finish_reason={choice.finish_reason} usage={completion.usage}")
    if choice.logprobs and choice.logprobs.top_logprobs:
        print("first token's top logprobs:", choice.logprobs.top_logprobs[0])

    print("\nstreamed (n=2, seed=0):")
    stream = client.completions.create(
        model=model,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temperature=0.8,
        n=2,
        seed=0,
        stream=True,
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    for i, text in enumerate(texts):
        print(f"[{i}] {args.prompt}{text}")


if __name__ == "__main__":
    main()
