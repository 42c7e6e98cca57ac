"""`xlm run-batch -i in.jsonl -o out.jsonl`: OpenAI batch files through the engine.

Each input line is an OpenAI batch request (`custom_id`, `method`, `url`, `body`) for
`/v1/completions` or `/v1/chat/completions`; each output line is the batch result
(`id`, `custom_id`, `response: {status_code, request_id, body}`, `error`), written in
input order. The requests go through the server's own handlers, so a result's body is
exactly what `xlm serve` would have answered. A rerun skips custom_ids already in the
output file. Data-parallel replicas (`--num-shards N --shard-index I`, one per host of a
pod) each take every N-th record into their own shard file; replica 0 merges the shards
into the output in input order once all are complete. Hosts without a shared disk: copy
the shard files into one directory and run `xlm run-batch -i in.jsonl -o out.jsonl
--num-shards N --merge` there. Under `--distributed-executor-backend multihost` one
replica is a group of hosts running one model: every host of the group runs the same
command (its --process-id differs) and process 0 reads and writes the files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

from tqdm import tqdm

from xlm import envs
from xlm.logger import init_logger

logger = init_logger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def read_records(path: str) -> list[dict[str, Any]]:
    """The input file's requests, validated enough to fail early with the line number."""
    records = []
    seen: set[str] = set()
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or not isinstance(record.get("body"), dict):
                raise ValueError(f"{path}:{lineno}: expected an object with a 'body' object")
            custom_id = record.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                raise ValueError(f"{path}:{lineno}: 'custom_id' must be a non-empty string")
            if custom_id in seen:
                raise ValueError(f"{path}:{lineno}: duplicate custom_id {custom_id!r}")
            seen.add(custom_id)
            records.append(record)
    return records


def done_ids(path: str) -> set[str]:
    """custom_ids already answered in an existing output file (a partial last line is cut)."""
    if not os.path.exists(path):
        return set()
    ids: set[str] = set()
    good = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                ids.add(json.loads(line)["custom_id"])
            except (ValueError, KeyError):
                break  # a line cut by a crash: it and what follows are redone
            good += len(line)
    with open(path, "rb+") as f:
        f.truncate(good)
    return ids


def _result(
    custom_id: str, status: int, body: dict[str, Any], request_id: str | None
) -> dict[str, Any]:
    error = None
    if status != 200:
        err = body.get("error", {})
        error = {"code": err.get("code") or err.get("type"), "message": err.get("message")}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


async def answer(state: Any, record: dict[str, Any]) -> dict[str, Any]:
    """One batch request through the server's handlers; errors become error results."""
    from pydantic import ValidationError

    from xlm.engine.exceptions import EngineDeadError
    from xlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_exception

    custom_id = record["custom_id"]
    url = record.get("url")
    method = record.get("method", "POST")
    body = dict(record["body"])
    try:
        if url not in ENDPOINTS or method != "POST":
            raise OpenAIError(
                f"unsupported batch endpoint {method} {url!r}; supported: "
                f"POST {', '.join(ENDPOINTS)}",
                param="url",
            )
        body["stream"] = False  # batch results are whole responses
        try:
            if url == "/v1/completions":
                response = await state.completion.create_completion(
                    CompletionRequest.model_validate(body)
                )
            else:
                response = await state.chat.create_chat_completion(
                    ChatCompletionRequest.model_validate(body)
                )
        except ValidationError as e:
            first = e.errors()[0]
            raise OpenAIError(
                f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                param=str(first["loc"][0]) if first["loc"] else None,
            ) from e
        payload = response.model_dump(mode="json", exclude_none=True)
        return _result(custom_id, 200, payload, payload.get("id"))
    except EngineDeadError:
        raise  # the batch's failure, not this request's: a rerun must retry the record
    except Exception as e:  # the request's error, never the batch's
        error = error_from_exception(e)
        body = error.to_response().model_dump(mode="json")
        return _result(custom_id, int(error.status), body, None)


async def run_records(
    state: Any, records: list[dict[str, Any]], out_path: str, max_concurrency: int
) -> int:
    """Answer records concurrently, appending results to out_path in input order."""
    gate = asyncio.Semaphore(max_concurrency)

    async def bounded(record: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            return await answer(state, record)

    tasks = [asyncio.create_task(bounded(r)) for r in records]
    bar = tqdm(
        total=len(tasks), desc="Batch requests", unit="req", disable=envs.XLM_DISABLE_PROGRESS_BARS
    )
    failed = 0
    with open(out_path, "a") as out:
        for task in tasks:  # in input order, so a crash leaves a resumable prefix
            result = await task
            failed += result["error"] is not None
            out.write(json.dumps(result) + "\n")
            out.flush()
            bar.update(1)
    bar.close()
    return failed


def merge_shards(out_path: str, shard_paths: list[str], order: list[str]) -> None:
    """Write the shards' results into out_path in input order."""
    results: dict[str, str] = {}
    for path in shard_paths:
        with open(path) as f:
            for line in f:
                results[json.loads(line)["custom_id"]] = line
    missing = [custom_id for custom_id in order if custom_id not in results]
    if missing:
        raise ValueError(
            f"{len(missing)} record(s) are in no shard file, e.g. custom_id {missing[0]!r}: "
            "rerun the replica that owns them, then merge again"
        )
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        for custom_id in order:
            f.write(results[custom_id])
    os.replace(tmp, out_path)


def _shard_path(out_path: str, index: int, count: int) -> str:
    return f"{out_path}.shard-{index}-of-{count}"


async def run(args: argparse.Namespace) -> int:
    from xlm.entrypoints.openai.api_server import ServerState, build_engine

    records = read_records(args.input_file)
    n, i = args.num_shards, args.shard_index
    if not 0 <= i < n:
        raise ValueError(f"--shard-index={i} is invalid: allowed [0, {n})")
    order = [r["custom_id"] for r in records]
    if args.merge:
        shards = [_shard_path(args.output_file, k, n) for k in range(n)]
        absent = [p for p in shards if not os.path.exists(p)]
        if absent:
            raise FileNotFoundError(f"--merge: shard file(s) not found: {absent}")
        merge_shards(args.output_file, shards, order)
        logger.info("Merged %d shard(s) into %s.", n, args.output_file)
        return 0
    out_path = args.output_file if n == 1 else _shard_path(args.output_file, i, n)
    mine = records[i::n]
    finished = done_ids(out_path)
    todo = [r for r in mine if r["custom_id"] not in finished]
    logger.info(
        "%d requests in %s: %d for this replica, %d already done.",
        len(records),
        args.input_file,
        len(mine),
        len(mine) - len(todo),
    )
    failed = 0
    if todo:
        engine, registry = build_engine(args)
        from xlm.engine.exceptions import EngineDeadError

        try:
            state = ServerState(args, engine, registry)
            failed = await run_records(state, todo, out_path, args.max_concurrency)
        except EngineDeadError as e:
            logger.error(
                "The engine died (%s); the results written to %s so far are kept: rerun "
                "the same command to finish the remaining records.",
                str(e).splitlines()[0] if str(e) else "no message",
                out_path,
            )
            return 1
        finally:
            engine.shutdown()
    if n > 1:
        open(out_path + ".done", "w").close()
        if i == 0:
            shards = [_shard_path(args.output_file, k, n) for k in range(n)]
            deadline = time.monotonic() + args.merge_timeout
            while not all(os.path.exists(p + ".done") for p in shards):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"shards not complete after {args.merge_timeout} s: "
                        f"{[p for p in shards if not os.path.exists(p + '.done')]}"
                    )
                await asyncio.sleep(1.0)
            merge_shards(args.output_file, shards, order)
    logger.info("Wrote %s (%d failed requests).", args.output_file, failed)
    return 0


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    from xlm.entrypoints.openai.cli_args import add_engine_args, add_serving_args

    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-i", "--input-file", required=True, help="JSONL of batch requests")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL of results")
    parser.add_argument(
        "--max-concurrency", type=int, default=256, help="requests in flight at once"
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
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: asyncio.run(run(args)))


def main() -> int:
    from xlm.entrypoints.cli import main as cli_main

    return cli_main(["run-batch", *sys.argv[1:]])
