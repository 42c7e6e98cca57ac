"""LLMReplica: the stateful Ray Data UDF that runs rows through one xlm.LLM.

Ray Data builds one LLMReplica per actor (`map_batches(LLMReplica,
compute=ActorPoolStrategy(size=N))`), so the engine is built, loaded and compiled once per
replica. Rows carry one of `prompt` (text), `messages` (chat messages, whose content parts
may hold images as `image_url` parts, as in chat completions) or
`prompt_token_ids`, and optionally `sampling_params` (a dict of SamplingParams fields);
every input column is passed through, and the outputs add `generated_text`,
`generated_token_ids`, `finish_reason`, `num_input_tokens`, `num_generated_tokens` and
`error` (null, or why the engine rejected the row).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from xlm.entrypoints.llm import LLM
from xlm.logger import init_logger
from xlm.multimodal.chat import extract_images, with_images
from xlm.ray.engine_loop import EngineLoop
from xlm.sampling_params import SamplingParams
from xlm.tokenizer import apply_chat_template

logger = init_logger(__name__)

OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "num_input_tokens",
    "num_generated_tokens",
    "error",
)


def _output_schema() -> Any:
    import pyarrow as pa

    return {
        "generated_text": pa.string(),
        "generated_token_ids": pa.list_(pa.int64()),
        "finish_reason": pa.string(),
        "num_input_tokens": pa.int64(),
        "num_generated_tokens": pa.int64(),
        "error": pa.string(),
    }


def _drop_nulls(value: Any) -> Any:
    """Arrow fills fields a row lacks with nulls; the engine wants them absent."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


class RowGate:
    """Rows of normal batches run together (shared); a row under suspicion runs alone
    (exclusive: it waits for the running ones and goes before new ones)."""

    def __init__(self) -> None:
        self._cond: asyncio.Condition | None = None  # made on the loop that uses it
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with cond:
                self._shared -= 1
                cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        cond = self._condition()
        async with cond:
            self._waiting += 1
            await cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with cond:
                self._exclusive = False
                cond.notify_all()


class ReplicaContext:
    """Who this replica is (Ray actor id, pid) and its reports to the job's JobStats."""

    def __init__(self, stats: Any) -> None:
        import ray

        context = ray.get_runtime_context()
        self.replica = context.get_actor_id() or f"pid-{os.getpid()}"
        self.stats = stats
        self.gate = RowGate()
        with warnings.catch_warnings():  # Ray's property reads its own deprecated field
            warnings.simplefilter("ignore")
            restarted = bool(context.was_current_actor_reconstructed)
        if stats is not None:
            stats.replica_started.remote(self.replica, os.getpid(), restarted)

    def batch_started(self, rows: int) -> None:
        if self.stats is not None:
            self.stats.batch_started.remote(self.replica, rows)

    def batch_finished(self, rows: int, output_tokens: int) -> None:
        if self.stats is not None:
            self.stats.batch_finished.remote(self.replica, rows, output_tokens)


def batch_key(parts: list[str]) -> str:
    """A batch's identity across Ray's retries of it: a digest of its rows."""
    digest = hashlib.sha1()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


async def run_batch_rows(
    context: ReplicaContext,
    key: str,
    rows: list[Any],
    run_row: Callable[[Any], Awaitable[Any]],
    fatal_row: Callable[[Any], Any],
    engine_dead: Callable[[], bool] = lambda: False,
) -> list[Any]:
    """Answer a batch's rows: all at once; or, when a replica already died holding this
    batch (Ray is retrying it), one at a time with each row recorded before it runs, so
    that a row during which a replica died is answered by `fatal_row` on the next retry
    instead of failing the job."""
    attempt, fatal = (
        (1, []) if context.stats is None else await context.stats.begin_batch.remote(key)
    )
    if attempt == 1:
        async with context.gate.shared():
            results = await asyncio.gather(*(run_row(r) for r in rows))
    else:
        logger.warning(
            "Retry %d of a batch whose replica died: running its rows one by one", attempt - 1
        )
        results = []
        for index, row in enumerate(rows):
            if index in fatal:
                results.append(fatal_row(row))
                continue
            # Alone on the replica: if the process dies now, this row is the one.
            async with context.gate.exclusive():
                await context.stats.row_started.remote(key, index)
                results.append(await run_row(row))
                if engine_dead():  # this row took the engine down: the row stays marked
                    die_for_restart(RuntimeError("the engine died running a retried row"))
                await context.stats.row_finished.remote(key)
    if context.stats is not None:
        context.stats.end_batch.remote(key)
    return list(results)


def die_for_restart(error: BaseException) -> None:
    """The engine is dead: end this process so Ray restarts the replica and retries its
    batches (max_restarts / max_task_retries); an exception would only fail the batch."""
    logger.error("xlm engine died (%s): exiting so Ray restarts this replica", error)
    os._exit(1)


FATAL_ROW_ERROR = "the replica's process died while running this row; not retried again"


def _fatal_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"error": FATAL_ROW_ERROR}


class LLMReplica:
    """One xlm.LLM per Ray actor; `__call__` runs a batch of rows through it."""

    def __init__(
        self,
        model: str,
        engine_kwargs: dict[str, Any],
        default_sampling_params: dict[str, Any] | None = None,
        stats: Any = None,
    ) -> None:
        self.context = ReplicaContext(stats)
        self.llm = LLM(model=model, **engine_kwargs)
        self.loop = EngineLoop(self.llm.llm_engine)
        self.default_sampling_params = dict(default_sampling_params or {})

    def _prompt(self, row: dict[str, Any]) -> Any:
        given = [k for k in ("prompt", "messages", "prompt_token_ids") if row.get(k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a row needs exactly one of 'prompt', 'messages', 'prompt_token_ids'; got {given}"
            )
        if given[0] == "prompt":
            return row["prompt"]
        if given[0] == "prompt_token_ids":
            return {"prompt_token_ids": [int(t) for t in row["prompt_token_ids"]]}
        # Images in content parts (image_url: data URLs, or files and hosts the engine's
        # media policy allows) are loaded and checked as LLM.chat and the server do.
        processor = self.llm.llm_engine.processor
        messages, images = extract_images(
            _drop_nulls(list(row["messages"])),
            processor.media_policy,
            processor.mm_processor is not None,
        )
        ids = apply_chat_template(self.llm.get_tokenizer(), messages)
        return with_images({"prompt_token_ids": ids}, images)

    def _params(self, row: dict[str, Any]) -> Any:
        fields = {**self.default_sampling_params, **_drop_nulls(row.get("sampling_params") or {})}
        params = SamplingParams(**fields)
        if params.n != 1:
            raise ValueError(f"sampling_params.n={params.n} is invalid in a batch row: allowed 1")
        return params

    async def _one(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            future = self.loop.submit(self._prompt(row), self._params(row))
            output = await asyncio.wrap_future(future)
        except Exception as e:
            if self.loop.dead_error is not None:
                raise
            return {"error": f"{type(e).__name__}: {e}"}
        completion = output.outputs[0]
        return {
            "generated_text": completion.text,
            "generated_token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "num_input_tokens": len(output.prompt_token_ids or []),
            "num_generated_tokens": len(completion.token_ids),
            "error": None,
        }

    async def __call__(self, batch: Any) -> Any:
        """A pyarrow Table of rows in; the same table with the output columns added."""
        import pyarrow as pa

        rows = batch.to_pylist()
        self.context.batch_started(len(rows))
        key = batch_key([json.dumps(r, sort_keys=True, default=str) for r in rows])
        try:
            results = await run_batch_rows(self.context, key, rows, self._one, _fatal_row)
        except Exception as e:
            die_for_restart(e)
            raise
        schema = _output_schema()
        for name in OUTPUT_COLUMNS:
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(
                pa.field(name, schema[name]),
                pa.array([r.get(name) for r in results], type=schema[name]),
            )
        self.context.batch_finished(
            len(rows), sum(r.get("num_generated_tokens") or 0 for r in results)
        )
        return batch

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()
