"""Offline inference: complete a few prompts with xlm.LLM and print each completion.

    python examples/offline_inference.py                      # built-in SmolLM2-135M
    python examples/offline_inference.py --model DIR_OR_GGUF --max-tokens 32

Every engine option of `xlm generate` is accepted (--max-model-len, --token-buckets, ...).
"""

from __future__ import annotations

import argparse

import xlm
from xlm.engine.arg_utils import EngineArgs

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The three primary colors are",
    "In machine learning, a transformer is",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()

    llm = xlm.LLM.from_engine_args(EngineArgs.from_cli_args(args))
    params = xlm.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=0
    )
    for output in llm.generate(PROMPTS, params):
        print(f"Prompt:     {output.prompt!r}")
        print(f"Completion: {output.outputs[0].text!r}\n")


if __name__ == "__main__":
    main()
