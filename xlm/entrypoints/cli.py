"""The `xlm` command line: one subcommand per entry point module."""

from __future__ import annotations

import argparse
import importlib
import sys

import xlm
from xlm.engine.arg_utils import EngineArgs
from xlm.entrypoints import console
from xlm.executor.multihost import follow_if_follower

# Subcommand name -> (module under xlm.entrypoints, help). Each module defines
# add_parser(subparsers, name, help) whose parser sets `func`; adding a subcommand is a
# module and one line here. Only the chosen subcommand's module is imported: `xlm
# generate` does not pay for the server's or the planner's imports.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "collect-env": ("collect_env", "print versions, platform and plugins"),
    "generate": ("generate", "generate a completion for a prompt"),
    "chat": ("generate", "interactive chat on the terminal"),
    "convert": ("convert", "convert a GGUF file to a safetensors directory"),
    "plan": ("plan", "compile for a TPU slice here: memory per chip, programs, decode estimate"),
    "run-batch": ("run_batch_cli", "run a file of OpenAI batch requests"),
    "serve": ("serve", "start the OpenAI-compatible server"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `xlm` parser; with `command`, only that subcommand gets its full arguments
    (the others are listed, not imported)."""
    parser = argparse.ArgumentParser(prog="xlm", description=xlm.__doc__)
    parser.add_argument("--version", action="version", version=f"xlm {xlm.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if command is None or name == command:
            entry = importlib.import_module(f"xlm.entrypoints.{module}")
            entry.add_parser(subparsers, name, help_text)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `xlm` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    if argv[:1] == ["serve"]:
        # `serve --config FILE`: the file's flags join the command line before parsing, so
        # flags given on the command line win and nothing rereads sys.argv later.
        try:
            serve = importlib.import_module("xlm.entrypoints.serve")
            argv = ["serve", *serve.expand_argv(argv[1:])]
        except (ValueError, OSError) as e:
            console.err(f"xlm serve: error: {e}")
            return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        _follow_if_follower(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # Bad options, paths or a missing package: one clear line, no traceback.
        console.err(f"xlm {args.command}: error: {e}")
        return 2


def _follow_if_follower(args: argparse.Namespace) -> None:
    """A multihost follower runs no front end: it mirrors process 0's steps, then exits."""
    if getattr(args, "distributed_executor_backend", "uni") != "multihost":
        return
    follow_if_follower(EngineArgs.from_cli_args(args).create_parallel_config())


if __name__ == "__main__":
    sys.exit(main())
