"""`xlm serve MODEL [flags]`: the subcommand that parses the flags and runs the server.

Its own module so that the flags (`openai/cli_args.py`) and the server
(`openai/api_server.py`) do not import each other: this one imports both.
"""

from __future__ import annotations

import argparse
from typing import Any

from xlm.entrypoints.openai import api_server
from xlm.entrypoints.openai.cli_args import expand_config_file, make_arg_parser, settle_args


def expand_argv(argv: list[str]) -> list[str]:
    """The subcommand's arguments with --config FILE expanded (called before parsing)."""
    return expand_config_file(argv)


def add_parser(subparsers: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    """Register `xlm serve`."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    make_arg_parser(parser)
    parser.set_defaults(func=_run, _parser=parser)
    return parser


def _run(args: argparse.Namespace) -> int:
    # `xlm` expanded --config FILE before parsing (see xlm.entrypoints.cli.main).
    args = settle_args(args._parser, args)

    return api_server.run_server(args)
