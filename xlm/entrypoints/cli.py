"""The `xlm` command line: one subcommand per entry point module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import xlm

# Subcommand name -> (module, help). Each module defines add_parser(subparsers) whose
# parser sets `func`; modules import heavy dependencies only inside their functions.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "collect-env": ("xlm.entrypoints.collect_env", "print versions, platform and plugins"),
    "generate": ("xlm.entrypoints.generate", "generate a completion for a prompt"),
    "chat": ("xlm.entrypoints.generate", "interactive chat on the terminal"),
    "convert": ("xlm.entrypoints.convert", "convert a GGUF file to a safetensors directory"),
    "serve": ("xlm.entrypoints.openai.cli_args", "start the OpenAI-compatible server"),
}
# Subcommands whose issue has not landed yet.
PENDING: dict[str, str] = {
    "run-batch": "run a file of OpenAI batch requests",
}


def _pending(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"xlm {name}: not built yet", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlm", description=xlm.__doc__)
    parser.add_argument("--version", action="version", version=f"xlm {xlm.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    import importlib

    for name, (module_name, help_text) in SUBCOMMANDS.items():
        importlib.import_module(module_name).add_parser(subparsers, name, help_text)
    for name, help_text in PENDING.items():
        if name not in SUBCOMMANDS:
            sub = subparsers.add_parser(name, help=help_text)
            sub.set_defaults(func=_pending(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `xlm` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if extra and args.command not in PENDING:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # Bad options, paths or a missing package: one clear line, no traceback.
        print(f"xlm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
