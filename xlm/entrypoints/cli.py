"""The `xlm` command line: one subcommand per entry point module."""

from __future__ import annotations

import argparse
import sys

import xlm

# Subcommand name -> (module, help). Each module defines add_parser(subparsers) whose
# parser sets `func`; modules import heavy dependencies only inside their functions.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "collect-env": ("xlm.entrypoints.collect_env", "print versions, platform and plugins"),
    "generate": ("xlm.entrypoints.generate", "generate a completion for a prompt"),
    "chat": ("xlm.entrypoints.generate", "interactive chat on the terminal"),
    "convert": ("xlm.entrypoints.convert", "convert a GGUF file to a safetensors directory"),
    "run-batch": ("xlm.entrypoints.run_batch_cli", "run a file of OpenAI batch requests"),
    "serve": ("xlm.entrypoints.serve", "start the OpenAI-compatible server"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlm", description=xlm.__doc__)
    parser.add_argument("--version", action="version", version=f"xlm {xlm.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    import importlib

    for name, (module_name, help_text) in SUBCOMMANDS.items():
        importlib.import_module(module_name).add_parser(subparsers, name, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `xlm` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # `serve --config FILE`: the file's flags join the command line before parsing, so
        # flags given on the command line win and nothing rereads sys.argv later.
        from xlm.entrypoints.serve import expand_argv

        try:
            argv = ["serve", *expand_argv(argv[1:])]
        except (ValueError, OSError) as e:
            print(f"xlm serve: error: {e}", file=sys.stderr)
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
        print(f"xlm {args.command}: error: {e}", file=sys.stderr)
        return 2


def _follow_if_follower(args: argparse.Namespace) -> None:
    """A multihost follower runs no front end: it mirrors process 0's steps, then exits."""
    if getattr(args, "distributed_executor_backend", "uni") != "multihost":
        return
    from xlm.engine.arg_utils import EngineArgs
    from xlm.executor.multihost import follow_if_follower

    follow_if_follower(EngineArgs.from_cli_args(args).create_parallel_config())


if __name__ == "__main__":
    sys.exit(main())
