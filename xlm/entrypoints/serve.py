"""`xlm serve MODEL [flags]`: the subcommand that parses the flags and runs the server.

Its own module so that the flags (`openai/cli_args.py`) and the server
(`openai/api_server.py`) do not import each other: this one imports both. It spawns the
engine process first, with the engine arguments, then imports the server and builds the
config: the engine imports JAX, builds the same config and loads the model while this
process imports FastAPI and the handlers (seconds each on a small host).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from xlm.engine.mp_client import start_engine_process
from xlm.entrypoints.openai.cli_args import (
    create_engine_config,
    engine_args_from,
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
    # SIGTERM while the engine loads exits cleanly (the finally below stops the engine).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine_args = engine_args_from(args)
    engine_process = None
    if engine_args.data_parallel_size == 1:  # ranks start in their client
        engine_process = start_engine_process(engine_args)
    try:
        from xlm.entrypoints.openai import api_server

        # The engine builds the same config meanwhile; after the imports, a cold start
        # finds the GGUF config the engine cached instead of converting it again.
        config = engine_args.create_config()
        return api_server.run_server(args, config, engine_process)
    finally:
        if engine_process is not None:
            engine_process.close()  # once the server stopped it: nothing left to do


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
