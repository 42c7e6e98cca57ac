"""`xlm generate` (one completion) and `xlm chat` (interactive chat on the terminal)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from xlm.engine.arg_utils import EngineArgs
from xlm.entrypoints import console
from xlm.entrypoints.llm import LLM
from xlm.sampling_params import RequestOutputKind, SamplingParams


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--repetition-penalty", type=float, default=None)
    group.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="seed of this request's sampling",
    )
    group.add_argument("--n", type=int, default=1, help="completions per prompt")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeat)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    kwargs: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "n": args.n,
        "ignore_eos": args.ignore_eos,
        "seed": args.sampling_seed,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return SamplingParams(**kwargs)


def _make_llm(args: argparse.Namespace, startup_programs: str):
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.startup_programs is None:  # --startup-programs wins
        engine_args.startup_programs = startup_programs
    # The engine in its own process, spawned first: it imports JAX and loads the model
    # while this process does the same imports and loads the tokenizer (on 2 cores, the
    # tokenizer no longer waits behind the weights or competes with them for the GIL).
    return LLM.from_engine_args(engine_args, multiprocess=True)


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # a bad value: cli.main prints it, exit code 2
    # One prompt, then exit: compile what its steps use, nothing in the background.
    llm = _make_llm(args, "used")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.chat_template_prompt:
        outputs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompt, params, use_tqdm=False)
    for completion in outputs[0].outputs:
        console.out((prompt if args.echo else "") + completion.text)
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args, "first-use")
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    console.err("Chat with the model; an empty line or Ctrl-D ends the session.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        params.output_kind = RequestOutputKind.FINAL_ONLY
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        console.out(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text)
    if name == "generate":
        parser.add_argument(
            "prompt", nargs="?", default=None, help="the prompt (default: read standard input)"
        )
        parser.add_argument(
            "--chat-template-prompt",
            action="store_true",
            help="wrap the prompt as a user message in the chat template",
        )
        parser.add_argument("--echo", action="store_true", help="print the prompt too")
        parser.set_defaults(func=_run_generate)
    else:
        parser.add_argument("--system", default=None, help="system message")
        parser.set_defaults(func=_run_chat)
    _add_sampling_args(parser)
    EngineArgs.add_cli_args(parser, skip=("seed",))
    parser.add_argument(
        "--engine-seed", dest="seed", type=int, default=0, help="seed of the engine's random state"
    )
