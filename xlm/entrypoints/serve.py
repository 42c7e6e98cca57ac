"""`xlm serve MODEL [flags]`: the subcommand that parses the flags and runs the server.

Its own module so that the flags (`openai/cli_args.py`) and the server
(`openai/api_server.py`) do not import each other: this one imports both.
"""

from __future__ import annotations

import argparse
from typing import Any

from xlm.entrypoints.openai import api_server
from xlm.entrypoints.openai.cli_args import (
    create_engine_config,
    expand_config_file,
    make_arg_parser,
    settle_args,
)


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
    if args.headless:
        return _run_headless(args)
    return api_server.run_server(args)


def _run_headless(args: argparse.Namespace) -> int:
    """`xlm serve --headless`: this host's data-parallel ranks, no API server."""
    from xlm.engine.dp_remote import run_headless

    config = create_engine_config(args)
    parallel = config.parallel_config
    if parallel.data_parallel_start_rank == 0 or parallel.data_parallel_address is None:
        raise ValueError(
            f"--headless with --data-parallel-start-rank={parallel.data_parallel_start_rank} "
            f"and --data-parallel-address={parallel.data_parallel_address}: allowed a start "
            "rank >= 1 (rank 0 runs beside the API server) and the API server's address"
        )
    return run_headless(config, log_stats=not args.disable_log_stats)
