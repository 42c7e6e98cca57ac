"""`xlm run-batch -i in.jsonl -o out.jsonl`: OpenAI batch files through the engine.

Each input line is an OpenAI batch request (`custom_id`, `method`, `url`, `body`) for
`/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`, `/v1/score`, `/v1/rerank`
or `/v1/classify` (and vLLM's other paths of those); each output line is the batch result
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
import hashlib
import json
import os
import time
import uuid
from typing import Any

from tqdm import tqdm

from xlm import envs
from xlm.entrypoints import console
from xlm.entrypoints.openai.cli_args import check_max_logprobs
from xlm.entrypoints.openai.embedding_protocol import EmbeddingRequest
from xlm.entrypoints.openai.engine_setup import ServerState, build_engine
from xlm.entrypoints.openai.messages_protocol import MessagesRequest
from xlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from xlm.entrypoints.openai.responses_protocol import ResponsesRequest
from xlm.entrypoints.openai.score_protocol import SCORE_ENDPOINTS
from xlm.entrypoints.openai.serving_engine import (
    OpenAIError,
    error_from_exception,
    error_from_validation,
)
from xlm.logger import init_logger

logger = init_logger(__name__)

# url -> (its request model, the ServerState handler and method that answer it)
ENDPOINTS: dict[str, tuple[type, str, str]] = {
    "/v1/completions": (CompletionRequest, "completion", "create_completion"),
    "/v1/chat/completions": (ChatCompletionRequest, "chat", "create_chat_completion"),
    "/v1/embeddings": (EmbeddingRequest, "embedding", "create_embedding"),
    **SCORE_ENDPOINTS,
    "/v1/responses": (ResponsesRequest, "responses", "create_response"),
    "/v1/messages": (MessagesRequest, "messages", "create_message"),
}


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
            if not isinstance(record, dict):
                # Valid JSON but no request: this line alone gets an error result.
                record = {
                    "custom_id": f"line-{lineno}",
                    "input_error": f"line {lineno}: expected a JSON object, "
                    f"got {type(record).__name__}",
                }
            elif not isinstance(record.get("body"), dict):
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
    """custom_ids already answered in an existing output file (a partial last line is cut).

    A line that is not a whole JSON result object (torn by a crash) is cut with
    everything after it; those records are answered again.
    """
    if not os.path.exists(path):
        return set()
    ids: set[str] = set()
    good = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                result = json.loads(line)
            except ValueError:
                break
            if not line.endswith(b"\n") or not isinstance(result, dict):
                break
            custom_id = result.get("custom_id")
            if not isinstance(custom_id, str):
                break
            ids.add(custom_id)
            good += len(line)
    with open(path, "rb+") as f:
        f.truncate(good)
    return ids


def batch_result(
    custom_id: str, status: int, body: dict[str, Any], request_id: str | None
) -> dict[str, Any]:
    """One output line of the OpenAI batch format (also written by the Ray path)."""
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

    custom_id = record["custom_id"]
    if "input_error" in record:
        message = record["input_error"]
        body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
        return batch_result(custom_id, 400, body, None)
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
        model, owner, method = ENDPOINTS[url]
        if "stream" in model.model_fields:
            body["stream"] = False  # batch results are whole responses
        try:
            request = model.model_validate(body)
            response = await getattr(getattr(state, owner), method)(request)
        except ValidationError as e:
            raise error_from_validation(e.errors()) from e
        payload = response.model_dump(mode="json", exclude_none=True)
        return batch_result(custom_id, 200, payload, payload.get("id"))
    except Exception as e:  # the request's error, never the batch's
        error = error_from_exception(e)
        body = error.to_response().model_dump(mode="json")
        return batch_result(custom_id, int(error.status), body, None)


# Output is flushed and fsynced at least this often (seconds), and at exit.
FSYNC_INTERVAL_S = 2.0


class BatchStopped(RuntimeError):
    """The engine died mid-job: the records not yet answered were not written."""

    def __init__(self, cause: BaseException, unanswered: int) -> None:
        super().__init__(
            f"the engine died ({cause}); {unanswered} records were not answered and not "
            "written: rerun the same command to answer them"
        )
        self.unanswered = unanswered


def is_final(result: dict[str, Any]) -> bool:
    """A success or the request's own (4xx) error; 5xx results are redone on a rerun."""
    return int(result["response"]["status_code"]) < 500


class _Output:
    """The output file, appended to; flushed and fsynced at a bounded interval and at close."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")
        self.last_sync = time.monotonic()

    def write(self, result: dict[str, Any]) -> None:
        self.file.write(json.dumps(result) + "\n")
        self.file.flush()
        if time.monotonic() - self.last_sync >= FSYNC_INTERVAL_S:
            self.sync()

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.last_sync = time.monotonic()

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self.file.close()


async def run_records(
    state: Any, records: list[dict[str, Any]], out_path: str, max_concurrency: int
) -> tuple[int, int]:
    """Answer records concurrently, appending final results to out_path in input order.

    Returns (failed, redo): results written with an error, and records whose result was
    a server error (5xx, not written, so a rerun answers them). Raises BatchStopped when
    the engine dies: nothing from that record on is written.
    """
    gate = asyncio.Semaphore(max_concurrency)
    engine = state.engine

    async def bounded(record: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            return await answer(state, record)

    tasks = [asyncio.create_task(bounded(r)) for r in records]
    bar = tqdm(
        total=len(tasks), desc="Batch requests", unit="req", disable=envs.XLM_DISABLE_PROGRESS_BARS
    )
    failed = redo = 0
    out = _Output(out_path)
    try:
        for done, task in enumerate(tasks):  # in input order: a crash leaves a resumable prefix
            result = await task
            if not is_final(result):
                if engine.errored:
                    raise BatchStopped(engine.dead_error, len(tasks) - done)
                redo += 1
                continue
            failed += result["error"] is not None
            out.write(result)
            bar.update(1)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out.close()
        bar.close()
    return failed, redo


def reorder(out_path: str, order: list[str]) -> None:
    """Rewrite a complete output file in input order (results redone on a rerun were
    appended at the end)."""
    lines: dict[str, str] = {}
    with open(out_path) as f:
        for line in f:
            lines[json.loads(line)["custom_id"]] = line
    if list(lines) == order or set(lines) != set(order):
        return
    _write_atomic(out_path, [lines[c] for c in order])


def _write_atomic(path: str, lines: list[str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    _write_atomic(out_path, [results[custom_id] for custom_id in order])


def _shard_path(out_path: str, index: int, count: int) -> str:
    return f"{out_path}.shard-{index}-of-{count}"


def input_digest(path: str) -> str:
    """sha256 of the input file: a shard's completion marker names the input it is for."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _marker_ok(shard_path: str, digest: str) -> bool:
    """Whether a shard's completion marker was written by a run over this same input."""
    try:
        with open(shard_path + ".done") as f:
            return f.read().strip() == digest
    except OSError:
        return False


async def run(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} is invalid: must be >= 1")

    check_max_logprobs(args.max_logprobs)
    records = read_records(args.input_file)
    n, i = args.num_shards, args.shard_index
    if not 0 <= i < n:
        raise ValueError(f"--shard-index={i} is invalid: allowed [0, {n})")
    digest = input_digest(args.input_file) if n > 1 else ""
    order = [r["custom_id"] for r in records]
    if getattr(args, "merge", False):
        shards = [_shard_path(args.output_file, k, n) for k in range(n)]
        absent = [p for p in shards if not os.path.exists(p)]
        if absent:
            raise FileNotFoundError(f"--merge: shard file(s) not found: {absent}")
        merge_shards(args.output_file, shards, order)
        logger.info("Merged %d shard(s) into %s.", n, args.output_file)
        return 0
    out_path = args.output_file if n == 1 else _shard_path(args.output_file, i, n)
    if n > 1 and os.path.exists(out_path + ".done"):
        os.remove(out_path + ".done")  # this run decides afresh whether the shard is complete
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
    failed = redo = 0
    if todo:
        engine, registry = build_engine(args)
        try:
            state = ServerState(args, engine, registry)
            await state.models.check_lora_modules()  # a bad adapter fails the job at once
            failed, redo = await run_records(state, todo, out_path, args.max_concurrency)
        except BatchStopped as e:
            console.err(f"xlm run-batch: error: {e}")
            return 1
        finally:
            engine.shutdown()
    failed += count_failed(out_path, finished)
    if redo:
        console.err(
            f"xlm run-batch: error: {redo} records got a server error and were not written: "
            "rerun the same command to answer them"
        )
        return 1
    if n == 1:
        reorder(out_path, [r["custom_id"] for r in mine])
    else:
        with open(out_path + ".done", "w") as f:
            f.write(digest)
        if i == 0:
            shards = [_shard_path(args.output_file, k, n) for k in range(n)]
            deadline = time.monotonic() + args.merge_timeout
            while not all(_marker_ok(p, digest) for p in shards):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"shards not complete after {args.merge_timeout} s: "
                        f"{[p for p in shards if not _marker_ok(p, digest)]}"
                    )
                await asyncio.sleep(1.0)
            merge_shards(args.output_file, shards, order)
    logger.info("Wrote %s (%d failed requests).", args.output_file, failed)
    if failed:
        console.err(
            f"xlm run-batch: {failed} of {len(mine)} records failed (their error results are "
            f"in {out_path})"
        )
        return 1
    return 0


def count_failed(out_path: str, ids: set[str]) -> int:
    """Error results among `ids` in an output file (those answered by an earlier run)."""
    if not ids or not os.path.exists(out_path):
        return 0
    failed = 0
    with open(out_path) as f:
        for line in f:
            result = json.loads(line)
            failed += result["custom_id"] in ids and result.get("error") is not None
    return failed
