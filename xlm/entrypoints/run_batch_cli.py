"""`xlm run-batch`: its command-line options, and the choice between the local run and Ray.

Apart from `xlm.entrypoints.run_batch` (the records and their handlers), because the Ray
path (`xlm.ray.batch`) is built on those handlers: keeping the command here keeps the
import graph acyclic.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from xlm.entrypoints import run_batch
from xlm.entrypoints.openai.cli_args import (
    add_engine_args,
    add_lora_args,
    add_serving_args,
    check_lora_args,
)
from xlm.entrypoints.run_batch import run


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=run_batch.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-i", "--input-file", required=True, help="JSONL of batch requests")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL of results")
    parser.add_argument(
        "--max-concurrency", type=int, default=256, help="requests in flight at once (>= 1)"
    )
    parser.add_argument(
        "--num-shards", type=int, default=1, help="data-parallel replicas (one per host)"
    )
    parser.add_argument("--shard-index", type=int, default=0, help="this replica's index")
    parser.add_argument(
        "--merge-timeout",
        type=float,
        default=24 * 3600.0,
        help="seconds replica 0 waits for the other shards",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="only merge the --num-shards shard files of --output-file (copied from the "
        "hosts) into it, in input order; runs no model",
    )
    add_serving_args(parser)
    add_lora_args(parser, runtime=False)  # a line's body.model may name an adapter
    add_engine_args(parser)
    from xlm.ray.batch import add_ray_args

    add_ray_args(parser)
    parser.set_defaults(func=_run_local_or_ray)


def _run_local_or_ray(args: argparse.Namespace) -> int:
    check_lora_args(args)
    if args.ray:  # the same records and handlers (answer), spread over a Ray cluster
        from xlm.ray.batch import run_batch_on_ray

        run_batch_on_ray(args)
        return 0
    return asyncio.run(run(args))
