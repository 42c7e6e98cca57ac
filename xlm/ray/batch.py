"""`xlm run-batch --ray`: OpenAI batch files (JSONL or Parquet) through xlm replicas on Ray Data.

The records are read by Ray (local paths on a shared disk, `s3://`, `gs://`), parsed and
validated in Ray tasks, and answered by `BatchReplica` actors, each running the engine and
the server's handlers exactly as the local run-batch does (`run_batch.answer`), so a
result is the same JSON either way. The driver writes the results in input order
(Ray Data's `preserve_order`) to one output file; a rerun on a local JSONL output skips
the custom_ids already written, like the local run-batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from xlm import envs
from xlm.engine.exceptions import EngineDeadError
from xlm.entrypoints.openai.engine_setup import ServerState, build_engine
from xlm.entrypoints.run_batch import answer, batch_result, done_ids
from xlm.logger import init_logger
from xlm.ray.config import ProcessorConfig
from xlm.ray.processor import configure_retries, map_replicas, start_job_stats
from xlm.ray.replica import (
    FATAL_ROW_ERROR,
    ReplicaContext,
    _drop_nulls,
    batch_key,
    die_for_restart,
    run_batch_rows,
)
from xlm.ray.stats import format_summary, summarize

logger = init_logger(__name__)

FORMATS = ("jsonl", "parquet")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """The run-batch flags of the Ray path."""
    group = parser.add_argument_group("Ray Data (--ray)")
    group.add_argument("--ray", action="store_true", help="run the batch on a Ray cluster")
    group.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join (host:port or 'auto'); unset: start a local one",
    )
    group.add_argument("--replicas", type=int, default=1, help="engine replicas (Ray actors)")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica")
    group.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica")
    group.add_argument("--replica-tpu-chips", type=int, default=0, help="TPU chips per replica")
    group.add_argument(
        "--ray-batch-size", type=int, default=64, help="records per batch sent to a replica"
    )
    group.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=4,
        help="batches one replica holds at once (keeps its engine busy between batches)",
    )
    group.add_argument("--max-restarts", type=int, default=4, help="restarts of a dead replica")
    group.add_argument(
        "--max-task-retries", type=int, default=4, help="retries of a batch whose replica died"
    )
    group.add_argument("--input-format", choices=FORMATS, default=None, help="default: by suffix")
    group.add_argument("--output-format", choices=FORMATS, default=None, help="default: by suffix")


def file_format(path: str, given: str | None) -> str:
    """The format named by a flag, else by the path's suffix (.parquet/.pq), else JSONL."""
    if given is not None:
        return given
    return "parquet" if path.rstrip("/").endswith((".parquet", ".pq")) else "jsonl"


def _is_local(path: str) -> bool:
    return "://" not in path


def _ray_path(path: str) -> str:
    return os.path.abspath(path) if _is_local(path) else path


def processor_config(args: argparse.Namespace) -> ProcessorConfig:
    """The ProcessorConfig the run-batch flags describe."""
    return ProcessorConfig(
        model=args.model,
        replicas=args.replicas,
        batch_size=args.ray_batch_size,
        max_concurrent_batches=args.max_concurrent_batches,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        num_tpu_chips=args.replica_tpu_chips,
        max_restarts=args.max_restarts,
        max_task_retries=args.max_task_retries,
        retry_exceptions=[EngineDeadError],
    )


# ---- parsing (Ray tasks) -----------------------------------------------------------------


def _record_from_line(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"input line {line[:80]!r}: not valid JSON ({e.msg})") from e
    if not isinstance(record, dict):
        raise ValueError(f"input line {line[:80]!r}: expected an object with a 'body' object")
    return record


def _record_from_row(row: dict[str, Any]) -> dict[str, Any]:
    record = {k: v for k, v in row.items() if v is not None}
    if isinstance(record.get("body"), str):
        try:
            record["body"] = json.loads(record["body"])
        except json.JSONDecodeError as e:
            raise ValueError(
                f"record {record.get('custom_id')!r}: 'body' is not valid JSON ({e.msg})"
            ) from e
    elif isinstance(record.get("body"), dict):
        record["body"] = _drop_nulls(record["body"])  # Arrow's nulls for absent fields
    return record


def parse_batch(batch: Any) -> dict[str, list[Any]]:
    """Rows of JSONL text or Parquet records -> (custom_id, record as JSON), validated."""
    rows = batch.to_pylist()
    if "text" in batch.column_names and "body" not in batch.column_names:
        records = [_record_from_line(r["text"]) for r in rows if r["text"].strip()]
    else:
        records = [_record_from_row(r) for r in rows]
    for record in records:
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise ValueError(
                f"record {json.dumps(record)[:80]}: 'custom_id' must be a non-empty string"
            )
        if not isinstance(record.get("body"), dict):
            raise ValueError(f"record {custom_id!r}: expected a 'body' object")
    return {
        "custom_id": [r["custom_id"] for r in records],
        "record": [json.dumps(r) for r in records],
    }


# ---- the replica (a Ray actor) -----------------------------------------------------------


def _fatal_record(record: dict[str, Any]) -> dict[str, Any]:
    """The error result of a record during which a replica died (after Ray's retries)."""
    body = {"error": {"message": FATAL_ROW_ERROR, "type": "InternalServerError", "code": 500}}
    return batch_result(record["custom_id"], 500, body, None)


class BatchReplica:
    """One engine + the server's handlers per Ray actor; answers a batch of records."""

    def __init__(self, args: dict[str, Any], stats: Any = None) -> None:
        self.context = ReplicaContext(stats)
        namespace = argparse.Namespace(**args)
        self.engine, registry = build_engine(namespace)
        self.state = ServerState(namespace, self.engine, registry)
        self.max_concurrency = namespace.max_concurrency
        self._gate: asyncio.Semaphore | None = None
        self._lora_checked = False

    async def __call__(self, batch: Any) -> dict[str, list[Any]]:
        if self._gate is None:  # made on Ray's event loop, where the calls run
            self._gate = asyncio.Semaphore(self.max_concurrency)
        if not self._lora_checked:  # a bad --lora-modules adapter fails the job
            await self.state.models.check_lora_modules()
            self._lora_checked = True
        records = [json.loads(r) for r in batch.column("record").to_pylist()]
        self.context.batch_started(len(records))

        async def bounded(record: dict[str, Any]) -> dict[str, Any]:
            async with self._gate:
                return await answer(self.state, record)

        key = batch_key([r["custom_id"] for r in records])
        results = await run_batch_rows(
            self.context, key, records, bounded, _fatal_record, lambda: self.engine.errored
        )
        if self.engine.errored:  # 5xx results of a dead engine are not answers: retry
            die_for_restart(self.engine.dead_error or RuntimeError("engine dead"))
        tokens = sum(
            (r["response"]["body"].get("usage") or {}).get("completion_tokens", 0)
            for r in results
            if r["error"] is None
        )
        self.context.batch_finished(len(records), tokens)
        return {
            "custom_id": [r["custom_id"] for r in results],
            "result": [json.dumps(r) for r in results],
        }


# ---- the driver --------------------------------------------------------------------------


def _read(args: argparse.Namespace) -> Any:
    import ray.data

    path = _ray_path(args.input_file)
    if file_format(args.input_file, args.input_format) == "parquet":
        dataset = ray.data.read_parquet(path)
    else:
        dataset = ray.data.read_text(path)
    return dataset.map_batches(parse_batch, batch_format="pyarrow")


def _check_ids(parsed: Any, done: set[str]) -> tuple[int, int]:
    """Fail on a duplicate custom_id before any engine starts; (records, already done)."""
    seen: set[str] = set()
    already = 0
    for batch in parsed.select_columns(["custom_id"]).iter_batches(batch_format="pyarrow"):
        for custom_id in batch.column("custom_id").to_pylist():
            if custom_id in seen:
                raise ValueError(f"{custom_id!r}: duplicate custom_id in the input")
            seen.add(custom_id)
            already += custom_id in done
    return len(seen), already


class _Writer:
    """Results to one file in arrival (= input) order: JSONL lines or Parquet rows."""

    def __init__(self, path: str, fmt: str, append: bool) -> None:
        self.fmt = fmt
        if _is_local(path):
            self.stream = open(path, "ab" if append else "wb")  # noqa: SIM115
        else:
            import pyarrow.fs

            fs, inner = pyarrow.fs.FileSystem.from_uri(path)
            self.stream = fs.open_output_stream(inner)
        self.parquet: Any = None

    def write(self, results: list[dict[str, Any]]) -> None:
        if self.fmt == "jsonl":
            self.stream.write("".join(json.dumps(r) + "\n" for r in results).encode())
            self.stream.flush()
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "id": [r["id"] for r in results],
                "custom_id": [r["custom_id"] for r in results],
                "status_code": [r["response"]["status_code"] for r in results],
                "response": [json.dumps(r["response"]) for r in results],
                "error": [json.dumps(r["error"]) if r["error"] else None for r in results],
                "embedding": [_embeddings(r) for r in results],
            },
            schema=RESULT_SCHEMA(),
        )
        if self.parquet is None:
            self.parquet = pq.ParquetWriter(self.stream, table.schema)
        self.parquet.write_table(table)

    def close(self) -> None:
        if self.parquet is not None:
            self.parquet.close()
        self.stream.close()


def RESULT_SCHEMA() -> Any:  # noqa: N802 - a constant built lazily (pyarrow is optional)
    """Columns of a Parquet result file: the JSONL result's fields, nested ones as JSON."""
    import pyarrow as pa

    return pa.schema(
        [
            ("id", pa.string()),
            ("custom_id", pa.string()),
            ("status_code", pa.int64()),
            ("response", pa.string()),
            ("error", pa.string()),
            # /v1/embeddings rows: each input's vector (float encoding), else null.
            ("embedding", pa.list_(pa.list_(pa.float32()))),
        ]
    )


def _embeddings(result: dict[str, Any]) -> list[list[float]] | None:
    """The vectors of an embeddings result (in input order), for Parquet's list column."""
    body = result["response"]["body"]
    data = body.get("data") if isinstance(body, dict) and body.get("object") == "list" else None
    if not data or not all(isinstance(d.get("embedding"), list) for d in data):
        return None
    return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]


def replica_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags a replica needs to build the engine and handlers (no callables)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def run_batch_on_ray(args: argparse.Namespace) -> dict[str, Any]:
    """Run the batch on the Ray cluster (joined or started); the job's closing figures."""
    import ray
    import ray.data

    if args.num_shards != 1:
        raise ValueError("--num-shards is the hand-sharded path: with --ray, use --replicas")
    out_format = file_format(args.output_file, args.output_format)
    config = processor_config(args)
    started_ray = not ray.is_initialized()
    if started_ray and args.ray_address is None:
        # A Ray instance on this machine: logical CPUs for every replica plus one for Ray
        # Data's read and write tasks, which would otherwise wait behind the replicas.
        cpus = max(os.cpu_count() or 1, int(config.replicas * config.num_cpus) + 1)
        ray.init(num_cpus=cpus, include_dashboard=False)
    elif started_ray:
        ray.init(address=args.ray_address)
    try:
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        if envs.XLM_DISABLE_PROGRESS_BARS:
            context.enable_progress_bars = False
        configure_retries(config)
        resume = out_format == "jsonl" and _is_local(args.output_file)
        done = done_ids(args.output_file) if resume else set()
        parsed = _read(args)
        total, already = _check_ids(parsed, done)
        logger.info(
            "%d requests in %s, %d already done; %d replicas on Ray.",
            total,
            args.input_file,
            already,
            config.replicas,
        )
        if done:
            parsed = parsed.filter(lambda row: row["custom_id"] not in done)
        stats = start_job_stats()
        results = map_replicas(
            parsed, BatchReplica, config, {"args": replica_args(args), "stats": stats}
        )
        start = time.perf_counter()
        written = failed = 0
        writer = _Writer(args.output_file, out_format, append=resume)
        try:
            if total > already:
                for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
                    rows = [json.loads(r) for r in batch.column("result").to_pylist()]
                    writer.write(rows)
                    written += len(rows)
                    failed += sum(r["error"] is not None for r in rows)
        finally:
            writer.close()
        elapsed = time.perf_counter() - start
        summary = summarize(ray.get(stats.snapshot.remote()), written, elapsed)
        summary["failed"] = failed
        logger.info(
            "Wrote %s (%d failed requests).\n%s", args.output_file, failed, format_summary(summary)
        )
        return summary
    finally:
        if started_ray:
            ray.shutdown()
